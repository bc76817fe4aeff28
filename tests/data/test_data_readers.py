"""DICOM, NIfTI and 16-bit PNG: full bit depth kept, CT windows, 2-D only, clear errors. Files are made here.

pydicom and nibabel come with ``medflare[dicom]`` (part of the ``test`` extra).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.data import DataConfig, load_source, make_site_data
from medflare.data.readers import WINDOW_PRESETS, Window, parse_window, read_image, stored_range
from medflare.errors import ConfigError, DataError

pydicom = pytest.importorskip("pydicom", reason="DICOM tests need pydicom: pip install medflare[dicom]")
nibabel = pytest.importorskip("nibabel", reason="NIfTI tests need nibabel: pip install medflare[dicom]")


def write_dicom(path: Path, stored: np.ndarray, intercept: float = -1024.0, monochrome: str = "MONOCHROME2",
                window: tuple[float, float] | None = None, tags: dict[str, str] | None = None) -> Path:
    """A CT-like 12-bit DICOM: stored values + intercept = Hounsfield units; ``tags`` e.g. its PatientID."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    dataset = Dataset()
    dataset.file_meta = meta
    dataset.SOPClassUID, dataset.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
    dataset.Modality = "CT"
    dataset.set_pixel_data(stored.astype(np.uint16), monochrome, bits_stored=12)
    dataset.RescaleIntercept, dataset.RescaleSlope = intercept, 1.0
    if window:
        dataset.WindowCenter, dataset.WindowWidth = window
    for tag, value in (tags or {}).items():
        setattr(dataset, tag, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset.save_as(path, enforce_file_format=True)
    return path


def write_nifti(path: Path, values: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nibabel.save(nibabel.Nifti1Image(values.astype(np.int16), affine=np.eye(4)), str(path))
    return path


def hounsfield_image(values: list[float]) -> np.ndarray:
    """Stored values (intercept -1024) for a 6x6 image whose first row holds ``values`` in HU."""
    stored = np.full((6, 6), 1024, dtype=np.int64)
    stored[0, : len(values)] = np.asarray(values) + 1024
    return stored


def test_dicom_keeps_every_level_of_a_12_bit_image(tmp_path: Path) -> None:
    """Two CT values 1 HU apart stay apart (an 8-bit cut of a 4096-level range would merge 16 levels into one)."""
    stored = np.arange(16, dtype=np.int64).reshape(4, 4) * 273  # 0 .. 4095
    stored[0, 1] = stored[0, 0] + 1
    path = write_dicom(tmp_path / "ct.dcm", stored)

    pixels = read_image(str(path))

    assert pixels.dtype == np.float32 and pixels.shape == (4, 4, 1)
    expected = (stored - stored.min()) / (stored.max() - stored.min())
    np.testing.assert_allclose(pixels[..., 0], expected, atol=1e-6)
    assert pixels[0, 1, 0] > pixels[0, 0, 0]


@pytest.mark.parametrize("window, expected", [
    ("brain", [0.0, 0.0, 0.5, 1.0, 1.0]),          # 40 +- 40 HU
    ("40,80", [0.0, 0.0, 0.5, 1.0, 1.0]),
    ("lung", [0.2333, 0.9, 0.9267, 0.9533, 1.0]),  # -600 +- 750 HU
])
def test_dicom_windows_map_hounsfield_units(tmp_path: Path, window: str, expected: list[float]) -> None:
    path = write_dicom(tmp_path / "ct.dcm", hounsfield_image([-1000, 0, 40, 80, 1000]))

    pixels = read_image(str(path), window=parse_window(window))

    np.testing.assert_allclose(pixels[0, :5, 0], expected, atol=1e-4)


def test_dicom_own_window_and_monochrome1(tmp_path: Path) -> None:
    """``data.window=file`` reads WindowCenter/WindowWidth; MONOCHROME1 (low values bright) is inverted."""
    own = write_dicom(tmp_path / "own.dcm", hounsfield_image([0, 40, 80]), window=(40, 80))
    inverted = write_dicom(tmp_path / "inv.dcm", hounsfield_image([0, 40, 80]), monochrome="MONOCHROME1")
    bare = write_dicom(tmp_path / "bare.dcm", hounsfield_image([0]))

    np.testing.assert_allclose(read_image(str(own), window="file")[0, :3, 0], [0.0, 0.5, 1.0])
    np.testing.assert_allclose(read_image(str(inverted), window=Window(40, 80))[0, :3, 0], [1.0, 0.5, 0.0])
    with pytest.raises(DataError, match="bare.dcm' has no WindowCenter/WindowWidth"):
        read_image(str(bare), window="file")


def test_nifti_slice_reads_rows_first_and_refuses_volumes(tmp_path: Path) -> None:
    """NIfTI stores x first: a slice written as [x, y] is read as [rows=y, columns=x]; a 3-D volume is refused."""
    values = np.arange(12).reshape(3, 4) * 100  # x = 3, y = 4
    path = write_nifti(tmp_path / "slice.nii.gz", values)

    pixels = read_image(str(path), channels=3, window=Window(550, 1100))

    assert pixels.shape == (4, 3, 3) and pixels.dtype == np.float32
    np.testing.assert_allclose(pixels[..., 0], values.T / 1100, atol=1e-6)
    volume = write_nifti(tmp_path / "volume.nii", np.zeros((4, 4, 3)))
    with pytest.raises(DataError, match="volume.nii' has shape \\(4, 4, 3\\); medflare reads 2-D slices only"):
        read_image(str(volume))
    with pytest.raises(DataError, match="data.window=file reads a DICOM's own window"):
        read_image(str(path), window="file")


def x_ray_12_bit() -> np.ndarray:
    """A 12-bit X-ray's stored values (125-3540), as a detector writes them into a 16-bit PNG or a DICOM."""
    return np.linspace(125, 3540, 36).round().reshape(6, 6).astype(np.uint16)


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_a_16_bit_png_or_tiff_reaches_the_network_as_its_dicom_does(tmp_path: Path, suffix: str) -> None:
    """16-bit PNG was divided by 65535 (a 12-bit X-ray trained on [0.002, 0.054]) while the same pixels as DICOM
    were min-max scaled to [0, 1] (issue 48, item 2): both now reach the site's tensors equal, with or without a
    window."""
    stored = x_ray_12_bit()
    for name in ("a", "b"):  # the same image in two class folders: a folder source needs two classes
        (tmp_path / "png" / name).mkdir(parents=True)
        Image.fromarray(stored).save(tmp_path / "png" / name / f"x{suffix}")
        write_dicom(tmp_path / "dcm" / name / "x.dcm", stored, intercept=0.0)
    for window in ("", "2000,3000"):
        tensors = {}
        for kind in ("png", "dcm"):
            cfg = DataConfig(source=f"folder:{tmp_path / kind}", num_sites=1, min_size=1, augment="none",
                             window=window)
            site = make_site_data(cfg, 0)
            tensors[kind] = np.stack([site.train[i][0].numpy() for i in range(len(site.train))])
        np.testing.assert_allclose(tensors["png"], tensors["dcm"], atol=1e-6)
        assert tensors["png"].min() == pytest.approx(-1.0) and tensors["png"].max() == pytest.approx(1.0)


def test_16_bit_png_keeps_its_levels(tmp_path: Path) -> None:
    levels = np.array([[0, 1, 2, 65535]], dtype=np.uint16)
    path = tmp_path / "xray.png"
    Image.fromarray(levels).save(path)

    pixels = read_image(str(path))

    assert pixels.dtype == np.float32
    np.testing.assert_allclose(pixels[0, :, 0], levels[0] / 65535.0, rtol=1e-6)
    assert len(np.unique(pixels)) == 4


def test_a_dicom_folder_trains_with_a_ct_window(tmp_path: Path) -> None:
    """Class folders of DICOMs load as a source; ``data.window`` reaches the site's tensors."""
    rng = np.random.default_rng(0)
    for name in ("bleed", "normal"):
        for i in range(10):
            write_dicom(tmp_path / "ct" / name / f"{i}.dcm", hounsfield_image(list(rng.uniform(-100, 200, 4))))
    cfg = DataConfig(source=f"folder:{tmp_path / 'ct'}", num_sites=1, min_size=1, window="brain", augment="none")

    site = make_site_data(cfg, 0)

    image, _ = site.train[0]
    raw = read_image(site.train.images.paths[0], 1, Window(*WINDOW_PRESETS["brain"]))
    expected = (raw[..., 0] - 0.5) / 0.5  # the transform's normalisation
    np.testing.assert_allclose(image[0].numpy(), expected, atol=1e-6)
    assert load_source(f"folder:{tmp_path / 'ct'}").info["class_names"] == ["bleed", "normal"]


def test_window_errors_name_the_fix(tmp_path: Path, png_class_folder) -> None:
    with pytest.raises(ConfigError, match="data.window='40' must be CENTER,WIDTH"):
        DataConfig(window="40")
    with pytest.raises(ConfigError, match="WIDTH > 0"):
        parse_window("40,-1")
    with pytest.raises(ConfigError, match="data.window applies to image files, not to the in-memory source"):
        make_site_data(DataConfig(source="synthetic:n=40", window="brain", min_size=1), 0)
    pngs = png_class_folder({"a": 10, "b": 10}, channels=3)
    site = make_site_data(DataConfig(source=f"folder:{pngs}", window="40,80", num_sites=1, min_size=1), 0)
    with pytest.raises(DataError, match="is a colour image; windowing applies to grayscale values"):
        site.train[0]
    png = tmp_path / "gray.png"
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(png)
    with pytest.raises(DataError, match="data.window=file reads a DICOM's own window, but .* is not a DICOM"):
        read_image(str(png), window="file")


def test_missing_reader_package_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    path = write_dicom(tmp_path / "ct.dcm", hounsfield_image([0]))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pydicom" else real(name, *a))
    with pytest.raises(DataError, match=r"needs the optional package 'pydicom'.*pip install medflare\[dicom\]"):
        read_image(str(path))


def test_stored_range_is_what_a_deeper_file_holds_before_scaling(tmp_path: Path) -> None:
    """Issue 61 minors: what preflight shows beside [0, 1] (HU for a CT, 0 to 4095 for a 12-bit TIFF)."""
    tiff = np.array([[3, 4095]], dtype=np.uint16)
    Image.fromarray(tiff).save(tmp_path / "x.tif")
    Image.fromarray(np.array([[3, 200]], dtype=np.uint8)).save(tmp_path / "x.png")
    ct = write_dicom(tmp_path / "ct.dcm", hounsfield_image([-1000, 400]))
    nifti = write_nifti(tmp_path / "x.nii.gz", np.array([[-5, 0], [7, 9]]))
    assert stored_range(str(tmp_path / "x.tif")) == (3.0, 4095.0)
    assert stored_range(str(ct)) == (-1000.0, 400.0)
    assert stored_range(str(nifti)) == (-5.0, 9.0)
    assert stored_range(str(tmp_path / "x.png")) is None  # 8-bit: read as is, nothing scaled


def test_a_window_is_noted_only_for_files_whose_values_are_grey_levels() -> None:
    from medflare.data.readers import window_note

    window = parse_window("brain")
    assert window_note(["a.dcm", "b.nii.gz"], window) == ""  # HU (or the scanner's units): what a window is for
    assert window_note(["a.png", "b.dcm"], None) == ""
    assert window_note(["a.png", "b.dcm", "c.TIF"], window).startswith(
        "data.window=40,80 is a window for DICOM/NIfTI values such as Hounsfield units, but 2 of 3 images are "
        "PNG/JPEG/TIFF files")
