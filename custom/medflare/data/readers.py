"""Decoding of single image files into `[H, W, C]` arrays, without losing bit depth.

An 8-bit image (PNG/JPEG/TIFF) comes back as uint8; anything deeper (16-bit PNG/TIFF, DICOM, NIfTI) as float32
in [0, 1], so a 12-bit X-ray keeps its 4096 levels. Deeper values are min-max scaled per image (a 16-bit PNG
reaches [0, 1] as its DICOM does), or with a window (:func:`parse_window`) clipped to [center - width/2,
center + width/2] and scaled, the same for every image, as radiologists read CT; colour images are never windowed.
DICOM values are in the file's units after the modality rescale (HU for CT), MONOCHROME1 inverted. DICOM (pydicom)
and NIfTI (nibabel) need `pip install medflare[dicom]`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from medflare.errors import ConfigError, DataError

PIL_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
DICOM_SUFFIXES = (".dcm",)
NIFTI_SUFFIXES = (".nii", ".nii.gz")
IMAGE_SUFFIXES = PIL_SUFFIXES + DICOM_SUFFIXES + NIFTI_SUFFIXES
# The optional package each medical format needs (installed by `pip install medflare[dicom]`).
_BACKENDS = {DICOM_SUFFIXES: "pydicom", NIFTI_SUFFIXES: "nibabel"}

# ITU-R 601-2 luma weights, the same as PIL's RGB -> L conversion.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)

#: Common CT windows (center, width) in Hounsfield units.
WINDOW_PRESETS: dict[str, tuple[float, float]] = {
    "brain": (40.0, 80.0),
    "subdural": (80.0, 200.0),
    "stroke": (40.0, 40.0),
    "soft_tissue": (50.0, 400.0),
    "mediastinum": (50.0, 350.0),
    "liver": (60.0, 160.0),
    "lung": (-600.0, 1500.0),
    "bone": (400.0, 1800.0),
}
#: The DICOM tags that name an image's patient, in the order tried (see `dicom_patient`).
DICOM_PATIENT_TAGS = ("PatientID", "StudyInstanceUID")
#: `data.window=file`: each DICOM's own WindowCenter/WindowWidth.
FILE_WINDOW = "file"
# PIL modes deeper than 8 bits: read with every level kept and scaled to [0, 1] (as a DICOM is)
DEEP_PIL_MODES = ("I;16", "I;16B", "I;16L", "I", "F")
# PIL modes read as one channel (_read_with_pil converts every other mode, palette and 1-bit too, to colour)
GREY_PIL_MODES = ("L", *DEEP_PIL_MODES)
CHANNEL_PROBES = 200  # image headers read to tell colour and grey files apart (channel_mix_note)


@dataclass(frozen=True)
class Window:
    """An intensity window (in the image's units, e.g. HU; width > 0): values in [center - width/2,
    center + width/2] map linearly to [0, 1]."""

    center: float
    width: float

    def apply(self, values: np.ndarray) -> np.ndarray:
        """float32 in [0, 1]: below the window is 0, above it 1."""
        low = self.center - self.width / 2.0
        return np.clip((values.astype(np.float64) - low) / self.width, 0.0, 1.0).astype(np.float32)


WindowSpec = Window | str | None  # a Window, FILE_WINDOW, or None (min-max per image)


def parse_window(text: str | None) -> WindowSpec:
    """`data.window` ("" none, "CENTER,WIDTH", a :data:`WINDOW_PRESETS` name or "file") as a :class:`Window`,
    :data:`FILE_WINDOW` or None; ConfigError naming the forms for anything else."""
    text = (text or "").strip().lower()
    if not text:
        return None
    if text == FILE_WINDOW:
        return FILE_WINDOW
    if text in WINDOW_PRESETS:
        return Window(*WINDOW_PRESETS[text])
    parts = text.split(",")
    try:
        center, width = (float(part) for part in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        center = width = None
    if center is None or width is None or not np.isfinite([center, width]).all() or width <= 0:
        raise ConfigError(f"data.window='{text}' must be CENTER,WIDTH with WIDTH > 0 (e.g. 40,80), '{FILE_WINDOW}' "
                          f"(the DICOM's own window) or a preset: {', '.join(WINDOW_PRESETS)}")
    return Window(center, width)


def is_image_file(path: str) -> bool:
    """Whether `path` has one of the supported image suffixes (case-insensitive)."""
    return path.lower().endswith(IMAGE_SUFFIXES)


def window_note(paths: Sequence[str], window: WindowSpec) -> str:
    """One line when a window (in the units of a DICOM's or NIfTI's values, e.g. HU) is set for PNG/JPEG/TIFF files,
    whose values are grey levels: it clips them as if they were HU, so images may come out blank; "" otherwise."""
    if not isinstance(window, Window):
        return ""
    grey_levels = sum(str(path).lower().endswith(PIL_SUFFIXES) for path in paths)
    if not grey_levels:
        return ""
    return (f"data.window={window.center:g},{window.width:g} is a window for DICOM/NIfTI values such as Hounsfield "
            f"units, but {grey_levels} of {len(paths)} images are PNG/JPEG/TIFF files, whose grey levels (0 to 255 "
            "for 8-bit) it clips as if they were HU (images may come out blank); remove data.window unless these "
            "files store HU")


def channel_mix_note(paths: Sequence[str], channels: int, most: int = CHANNEL_PROBES) -> str:
    """One line when PNG/JPEG/TIFF files among ``paths`` (up to ``most`` headers, spread evenly) mix colour and grey
    images: every image is then read with ``channels``, the first file's count, converted; "" otherwise."""
    from PIL import Image

    counts = {"colour": 0, "grey": 0}
    for path in list(paths)[::max(1, len(paths) // most)][:most]:
        if str(path).lower().endswith(PIL_SUFFIXES):
            try:
                with Image.open(path) as image:  # the header: no pixel is decoded
                    counts["grey" if image.mode in GREY_PIL_MODES else "colour"] += 1
            except Exception:  # noqa: BLE001 - a broken file is named when it is read (read_image's DataError)
                continue
    if not (counts["colour"] and counts["grey"]):
        return ""
    how = "grey ones repeated in 3 channels" if channels == 3 else "colour ones converted to grey"
    return (f"the images mix colour and grey files ({counts['colour']} colour, {counts['grey']} grey of "
            f"{sum(counts.values())} checked): all are read as {channels}-channel, as the first file is ({how}); to "
            "choose, convert them all to one kind")


def read_image(path: str, channels: int | None = None, window: WindowSpec = None) -> np.ndarray:
    """Decodes one image file into `[H, W, channels]`: uint8 for 8-bit files, float32 in [0, 1] for deeper ones.
    Grayscale is repeated or RGB reduced to luma as `channels` asks (None: the file's own); alpha is dropped.

    Raises:
        DataError: The file is missing, unreadable or not a 2-D image, its reader package is not installed, a
            window is asked of a colour image, or the DICOM's own window (`file`) of another format.
    """
    if not os.path.isfile(path):
        raise DataError(f"Image file '{path}' does not exist; fix the path or remove the entry.")
    lower = path.lower()
    try:
        if lower.endswith(PIL_SUFFIXES):
            pixels = _read_with_pil(path, window)
        elif lower.endswith(DICOM_SUFFIXES):
            pixels = _read_dicom(path, window)
        elif lower.endswith(NIFTI_SUFFIXES):
            pixels = _read_nifti(path, window)
        else:
            raise DataError(f"Image file '{path}' has an unsupported suffix; use one of {', '.join(IMAGE_SUFFIXES)}.")
    except DataError:
        raise
    except Exception as err:  # PIL/pydicom/nibabel raise many unrelated types for a broken file
        raise DataError(
            f"Cannot decode image file '{path}' ({type(err).__name__}: {err}); replace or remove the file."
        ) from err
    return to_channels(pixels, channels)


def stored_range(path: str) -> tuple[float, float] | None:
    """The lowest and highest value a deeper-than-8-bit grayscale file stores, before :func:`read_image` scales it
    to [0, 1] (a DICOM's after its modality rescale, e.g. in HU); None for an 8-bit or colour file, read as is. For
    a site's check of its images (a 12-bit TIFF's 0 to 4095), not for training."""
    lower = path.lower()
    if lower.endswith(PIL_SUFFIXES):
        from PIL import Image

        with Image.open(path) as image:
            values = np.asarray(image, dtype=np.float64) if image.mode in DEEP_PIL_MODES else None
    elif lower.endswith(DICOM_SUFFIXES):
        _require_backend(path)
        import pydicom

        dataset = pydicom.dcmread(path)
        values = None if int(getattr(dataset, "SamplesPerPixel", 1)) == 3 else _dicom_values(dataset)
    elif lower.endswith(NIFTI_SUFFIXES):
        _require_backend(path)
        values = _nifti_values(path)
    else:
        values = None
    return None if values is None else (float(values.min()), float(values.max()))


def to_channels(pixels: np.ndarray, channels: int | None) -> np.ndarray:
    """Converts `[H, W]` or `[H, W, C]` (C in 1, 3, 4; uint8 or float32) to `[H, W, channels]` (None = keep C)."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[-1] == 4:
        pixels = pixels[:, :, :3]
    have = pixels.shape[-1]
    if channels is None or have == channels:
        return np.ascontiguousarray(pixels)
    if have == 1 and channels == 3:
        return np.repeat(pixels, 3, axis=2)
    if have == 3 and channels == 1:
        luma = pixels.astype(np.float64) @ _LUMA
        if pixels.dtype == np.uint8:
            return np.clip(np.rint(luma), 0, 255).astype(np.uint8)[:, :, None]
        return luma.astype(np.float32)[:, :, None]
    raise DataError(f"Cannot convert an image with {have} channels to {channels}.")


def rescale_to_unit(pixels: np.ndarray) -> np.ndarray:
    """Maps any numeric array to float32 in [0, 1] by per-image min-max scaling (constant images become 0)."""
    values = pixels.astype(np.float64)
    low, high = float(values.min()), float(values.max())
    if high <= low:
        return np.zeros(values.shape, dtype=np.float32)
    return ((values - low) / (high - low)).astype(np.float32)


def _read_with_pil(path: str, window: WindowSpec) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        image.load()  # force full decoding here, so a truncated file fails now and not inside a DataLoader
        if image.mode in DEEP_PIL_MODES:
            # deeper than 8 bits: every level kept (PIL's convert("L") would clip at 255), scaled as a DICOM's
            return _scaled(np.asarray(image, dtype=np.float64), window, path)
        if image.mode not in ("L", "RGB", "RGBA"):
            image = image.convert("RGBA" if "A" in image.mode or "transparency" in image.info else "RGB")
        pixels = np.asarray(image, dtype=np.uint8)
    if window is None:
        return pixels
    if pixels.ndim == 3:
        raise DataError(f"data.window is set but '{path}' is a colour image; windowing applies to grayscale "
                        "values. Remove data.window for this source.")
    return _scaled(pixels, window, path)


def _scaled(values: np.ndarray, window: WindowSpec, path: str) -> np.ndarray:
    """Grayscale values as float32 in [0, 1]: through ``window``, else min-max per image.

    Raises:
        DataError: ``window`` is the DICOM's own (`file`), which only a DICOM has.
    """
    if window == FILE_WINDOW:
        raise DataError(f"data.window=file reads a DICOM's own window, but '{path}' is not a DICOM; give the window "
                        f"(e.g. data.window=40,80) or a preset ({', '.join(WINDOW_PRESETS)}).")
    return window.apply(values) if isinstance(window, Window) else rescale_to_unit(values)


def _require_backend(path: str) -> None:
    package = next(name for suffixes, name in _BACKENDS.items() if path.lower().endswith(suffixes))
    if importlib.util.find_spec(package) is None:
        raise DataError(
            f"Reading '{path}' needs the optional package '{package}', which is not installed; "
            "run `pip install medflare[dicom]` (or `pip install pydicom nibabel`) on this site."
        )


def _read_dicom(path: str, window: WindowSpec) -> np.ndarray:
    """A 2-D DICOM: modality rescale (e.g. to Hounsfield units), window or min-max, MONOCHROME1 inverted."""
    _require_backend(path)
    import pydicom

    dataset = pydicom.dcmread(path)
    pixels = dataset.pixel_array
    if int(getattr(dataset, "NumberOfFrames", 1) or 1) > 1:
        raise DataError(f"DICOM '{path}' holds {dataset.NumberOfFrames} frames; medflare reads 2-D images only. "
                        "Save the frames you want to classify as separate files first.")
    if int(getattr(dataset, "SamplesPerPixel", 1)) == 3:  # colour (e.g. dermoscopy, endoscopy): display values
        if window is not None:
            raise DataError(f"data.window is set but DICOM '{path}' is a colour image; windowing applies to "
                            "grayscale values. Remove data.window for this source.")
        return pixels.astype(np.uint8) if pixels.dtype != np.uint8 else pixels
    values = _dicom_values(dataset)
    if window == FILE_WINDOW:
        window = _dicom_own_window(dataset, path)
    scaled = window.apply(values) if isinstance(window, Window) else rescale_to_unit(values)
    if str(getattr(dataset, "PhotometricInterpretation", "")).upper() == "MONOCHROME1":
        scaled = 1.0 - scaled  # MONOCHROME1 shows low values bright; medflare's images are MONOCHROME2
    return scaled.astype(np.float32)


def _dicom_values(dataset: object) -> np.ndarray:
    """A grayscale DICOM's values in the file's units: its modality rescale applied (HU for CT)."""
    from pydicom.pixels import apply_modality_lut

    return np.asarray(apply_modality_lut(dataset.pixel_array, dataset), dtype=np.float64)


def _dicom_own_window(dataset: object, path: str) -> Window:
    center, width = getattr(dataset, "WindowCenter", None), getattr(dataset, "WindowWidth", None)
    if center is None or width is None:
        raise DataError(f"data.window=file but DICOM '{path}' has no WindowCenter/WindowWidth; give the window "
                        f"(e.g. data.window=40,80) or a preset ({', '.join(WINDOW_PRESETS)}).")
    first = [float(v[0]) if hasattr(v, "__len__") and not isinstance(v, str) else float(v) for v in (center, width)]
    return Window(*first)


def dicom_patient(path: str) -> tuple[str, str] | None:
    """The patient a DICOM file belongs to, as (tag, value): its PatientID, else its StudyInstanceUID (an
    anonymised file may blank the first); None when it has neither. Reads the header only, no pixel."""
    _require_backend(path)
    import pydicom

    try:
        header = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=list(DICOM_PATIENT_TAGS))
    except Exception as err:  # pydicom raises many unrelated types for a broken file
        raise DataError(f"Cannot read the DICOM header of '{path}' ({type(err).__name__}: {err}); replace or remove "
                        "the file.") from err
    for tag in DICOM_PATIENT_TAGS:
        value = str(getattr(header, tag, "") or "").strip()
        if value:
            return tag, value
    return None


def _read_nifti(path: str, window: WindowSpec) -> np.ndarray:
    """A 2-D NIfTI slice: scaled values (scl_slope/inter), window or min-max, rows = the second voxel axis."""
    _require_backend(path)
    values = _nifti_values(path)
    if values.ndim != 2:
        raise DataError(f"NIfTI '{path}' has shape {values.shape}; medflare reads 2-D slices only. "
                        "Extract the slices you want to classify into separate files first.")
    return _scaled(values.T, window, path)  # NIfTI stores x (columns) first; images here are [rows, columns]


def _nifti_values(path: str) -> np.ndarray:
    """A NIfTI file's scaled values (scl_slope/inter), size-1 axes dropped."""
    import nibabel

    return np.squeeze(np.asarray(nibabel.load(path).dataobj, dtype=np.float64))
