"""`load_source`: MedMNIST files, class folders and CSV manifests, with their error messages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from medflare.data import load_source
from medflare.data.sources import SOURCE_FORMS, stratified_split
from medflare.errors import ConfigError, DataError

# (file, channels, (train, val, test) sizes, train label counts) from ../shared/data/README.md
MEDMNIST_CASES = [
    ("pneumoniamnist.npz", 1, (4708, 524, 624), [1214, 3494]),
    ("retinamnist.npz", 3, (1080, 120, 400), [486, 128, 206, 194, 66]),
    ("breastmnist.npz", 1, (546, 78, 156), [147, 399]),
]


@pytest.mark.realdata
@pytest.mark.parametrize("name, channels, sizes, train_counts", MEDMNIST_CASES)
def test_medmnist_file_loads_with_readme_counts(medmnist_file: Callable[[str], Path], name: str, channels: int,
                                                 sizes: tuple[int, int, int], train_counts: list[int]) -> None:
    """Real MedMNIST files load with the channel count, split sizes and label counts of the README."""
    # Prepare
    path = medmnist_file(name)

    # Execute
    splits = load_source(f"medmnist:{path}")

    # Assert
    assert (len(splits.train), len(splits.val), len(splits.test)) == sizes
    assert splits.info["counts"]["train"] == train_counts
    assert splits.info["channels"] == channels and splits.info["image_size"] == 28
    image = splits.train.get_image(0)
    assert image.shape == (28, 28, channels) and image.dtype == np.uint8


@pytest.mark.realdata
def test_medmnist_declared_class_count_too_small_is_a_data_error(medmnist_file: Callable[[str], Path]) -> None:
    """RetinaMNIST has 5 grades; declaring 3 classes fails and names the file and the needed count."""
    path = medmnist_file("retinamnist.npz")
    with pytest.raises(DataError, match=r"retinamnist\.npz.*needs num_classes >= 5 but 3 is declared"):
        load_source(f"medmnist:{path}", num_classes=3)


def test_medmnist_layout_works_for_any_size_and_channel_count(tmp_path: Path) -> None:
    """A MedMNIST-style archive at 64 px RGB loads, and a missing key is named."""
    # Prepare
    rng = np.random.default_rng(0)
    arrays = {f"{split}_images": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
              for split, n in (("train", 12), ("val", 4), ("test", 5))}
    arrays |= {f"{split}_labels": rng.integers(0, 4, (len(arrays[f"{split}_images"]), 1), dtype=np.uint8)
               for split in ("train", "val", "test")}
    np.savez(tmp_path / "dermamnist_64.npz", **arrays)
    del arrays["val_labels"]
    np.savez(tmp_path / "broken.npz", **arrays)

    # Execute
    splits = load_source(f"medmnist:{tmp_path / 'dermamnist_64.npz'}", num_classes=4)

    # Assert
    assert splits.train.images.shape == (12, 64, 64, 3) and splits.info["image_size"] == 64
    with pytest.raises(DataError, match="broken.npz' lacks key.*val_labels"):
        load_source(f"medmnist:{tmp_path / 'broken.npz'}")


def test_folder_source_maps_sorted_class_names_and_splits_70_15_15(png_class_folder: Callable[..., Path]) -> None:
    """Sorted class folders become labels 0..K-1; without split folders a stratified 70/15/15 split is made."""
    # Prepare
    root = png_class_folder({"normal": 40, "benign": 20, "malignant": 20})

    # Execute
    splits = load_source(f"folder:{root}", seed=3)

    # Assert
    assert splits.info["class_names"] == ["benign", "malignant", "normal"]
    assert splits.info["counts"]["train"] == [14, 14, 28]
    assert splits.info["counts"]["val"] == [3, 3, 6] and splits.info["counts"]["test"] == [3, 3, 6]
    assert splits.info["channels"] == 1 and splits.info["image_size"] == 12
    assert splits.train.get_image(0).shape == (12, 12, 1)
    assert splits.train.paths == sorted(splits.train.paths, key=lambda p: (Path(p).parent.name, p))


def test_folder_source_uses_split_folders_and_detects_rgb(png_class_folder: Callable[..., Path]) -> None:
    """DIR/{train,val,test}/<class>/ is used as given; RGB files make a 3-channel source."""
    # Prepare
    root = png_class_folder({"a": 9, "b": 6}, channels=3, splits=True)

    # Execute
    splits = load_source(f"folder:{root}")

    # Assert
    assert (len(splits.train), len(splits.val), len(splits.test)) == (5, 5, 5)
    assert all("/train/" in path for path in splits.train.paths)
    assert splits.info["channels"] == 3 and splits.test.get_image(1).shape == (12, 12, 3)


def test_folder_class_count_mismatch_and_partial_splits_are_data_errors(
        png_class_folder: Callable[..., Path]) -> None:
    """Declared vs found class counts are both named; a lone train/ folder is rejected with the fix."""
    # Prepare
    root = png_class_folder({"a": 6, "b": 6, "c": 6})

    # Execute / Assert
    with pytest.raises(DataError, match=r"has 3 class folders \(a, b, c\) but num_classes=4 is declared"):
        load_source(f"folder:{root}", num_classes=4)
    (root / "train").mkdir()
    with pytest.raises(DataError, match="split folder.*train but not val, test"):
        load_source(f"folder:{root}")


def test_corrupt_png_raises_data_error_naming_file(png_class_folder: Callable[..., Path]) -> None:
    """A file that is not a decodable PNG fails on access with its file name in the message."""
    # Prepare
    root = png_class_folder({"a": 10, "b": 10})
    (root / "b" / "zz_corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    splits = load_source(f"folder:{root}")
    image_set = next(s for s in (splits.train, splits.val, splits.test)
                     if any("zz_corrupt" in p for p in s.paths))
    row = next(i for i, p in enumerate(image_set.paths) if "zz_corrupt" in p)

    # Execute / Assert
    with pytest.raises(DataError, match=rf"zz_corrupt\.png.*sample {row} of image set"):
        image_set.get_image(row)


def test_csv_manifest_reads_columns_relative_paths_and_splits(png_manifest: Callable[..., Path]) -> None:
    """path,label,site,attribute,split: paths relative to the CSV, all optional columns kept, splits honoured."""
    # Prepare
    rows = [{"path": f"img/{i}.png", "label": i % 3, "site": f"hospital-{i % 2}", "attribute": i % 2,
             "split": ("train", "train", "val", "test")[i % 4]} for i in range(24)]
    manifest = png_manifest(rows, header=("path", "label", "site", "attribute", "split"))

    # Execute
    splits = load_source(f"csv:{manifest}", num_classes=3)

    # Assert
    assert (len(splits.train), len(splits.val), len(splits.test)) == (12, 6, 6)
    assert Path(splits.train.paths[0]) == manifest.parent / "img" / "0.png"
    assert splits.train.labels.tolist()[:4] == [0, 1, 1, 2]
    assert splits.train.groups.tolist()[:2] == ["hospital-0", "hospital-1"]
    assert splits.val.attributes.tolist() == [0] * 6
    assert splits.train.get_image(3).shape == (12, 12, 1)


def test_csv_without_split_column_is_stratified(png_manifest: Callable[..., Path]) -> None:
    """Without a split column the manifest gets a seeded stratified 70/15/15 split."""
    # Prepare
    manifest = png_manifest([{"path": f"{i}.png", "label": i % 2} for i in range(40)])

    # Execute
    splits = load_source(f"csv:{manifest}", seed=1)

    # Assert
    assert splits.info["counts"] == {"train": [14, 14], "val": [3, 3], "test": [3, 3]}


@pytest.mark.parametrize("rows, num_classes, message", [
    ([{"path": "0.png", "label": 0}, {"path": "1.png", "label": 5}], 3,
     r"manifest\.csv' line 3: label 5 is outside \[0, 3\)"),
    ([{"path": "0.png", "label": -2}], None, r"line 2: label -2 is negative"),
    ([{"path": "0.png", "label": "cat"}], None, "line 2: label 'cat' is not an integer"),
    ([{"path": "0.png", "label": 0}, {"path": "missing.png", "label": 1}], None,
     r"line 3: image file '.*missing\.png' does not exist"),
])
def test_csv_bad_rows_raise_data_error_naming_the_row(png_manifest: Callable[..., Path], rows: list[dict],
                                                      num_classes: int | None, message: str) -> None:
    """Out-of-range or non-integer labels and missing files are reported with the CSV line."""
    manifest = png_manifest(rows)
    with pytest.raises(DataError, match=message):
        load_source(f"csv:{manifest}", num_classes=num_classes)


@pytest.mark.parametrize("spec, error, message", [
    ("folder:/nonexistent/medflare-images", DataError, "Image folder '/nonexistent/medflare-images' does not exist"),
    ("csv:/nonexistent/manifest.csv", DataError, "CSV manifest '/nonexistent/manifest.csv' does not exist"),
    ("medmnist:/nonexistent/x.npz", DataError, "MedMNIST file '/nonexistent/x.npz' does not exist"),
    ("hdf5:/data/x.h5", ConfigError, "Unknown data source 'hdf5:/data/x.h5'"),
    ("folder:", ConfigError, "Unknown data source"),
])
def test_bad_specs_and_missing_paths(spec: str, error: type, message: str) -> None:
    """Missing paths are DataErrors naming the path; unknown forms are ConfigErrors listing the valid ones."""
    with pytest.raises(error, match=message) as caught:
        load_source(spec)
    if error is ConfigError:
        assert all(form in str(caught.value) for form in SOURCE_FORMS)


@pytest.mark.parametrize("spec, hint", [
    ("{folder}", "(did you mean 'folder:{folder}'?)"),
    ("foldr:{folder}", "(did you mean 'folder:{folder}'?)"),
    ("/data/manifest.csv", "(did you mean 'csv:/data/manifest.csv'?)"),
    ("/data/chestmnist.npz", "(did you mean 'medmnist:/data/chestmnist.npz'?)"),
    ("medmnst:/data/x.npz", "(did you mean 'medmnist:/data/x.npz'?)"),
])
def test_a_source_without_its_kind_or_a_misspelt_kind_gets_the_likely_spelling(tmp_path: Path, spec: str,
                                                                                 hint: str) -> None:
    """Issue 61 (minors): a folder given without 'folder:' or a misspelt kind was only 'Unknown data source'."""
    spec, hint = spec.format(folder=tmp_path), hint.format(folder=tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_source(spec)
    assert str(caught.value).startswith(f"Unknown data source '{spec}' {hint}; valid forms: "), caught.value


def test_results_are_cached_and_read_only() -> None:
    """Repeated loads return the cached object, whose arrays cannot be written; get_image returns copies."""
    # Execute
    first, again = load_source("synthetic:n=50", seed=2), load_source("synthetic:n=50", seed=2)

    # Assert
    assert first is again
    with pytest.raises(ValueError):
        first.train.images[0, 0, 0, 0] = 1
    image = first.train.get_image(0)
    image[:] = 0
    assert first.train.images[0].any()


@pytest.mark.parametrize("counts", [[10, 10, 10], [1, 2, 100], [7, 3]])
def test_stratified_split_is_a_seeded_partition_keeping_every_class_in_train(counts: list[int]) -> None:
    """The 70/15/15 helper tiles the indices, is seed-stable, and never leaves a class out of train."""
    # Prepare
    labels = np.repeat(np.arange(len(counts)), counts)

    # Execute
    parts = stratified_split(labels, (0.7, 0.15, 0.15), seed=4)

    # Assert
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    assert set(labels[parts[0]]) == set(range(len(counts)))
    again = stratified_split(labels, (0.7, 0.15, 0.15), seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_csv_class_name_column_names_the_classes(png_manifest) -> None:
    rows = [{"path": f"img/{i}.png", "label": i % 2, "class_name": ("normal", "pneumonia")[i % 2]} for i in range(8)]
    manifest = png_manifest(rows, header=("path", "label", "class_name"))

    info = load_source(f"csv:{manifest}").info

    assert info["class_names"] == ["normal", "pneumonia"] and info["named_classes"]


@pytest.mark.parametrize("names, expected", [
    (["a", "b", "c", "b"], "line 4: label 0 is named 'c' here but 'a' earlier"),
    (["a", "a", "a", "a"], "'a' names both label 0 and label 1"),
])
def test_inconsistent_class_names_are_refused(png_manifest, names: list[str], expected: str) -> None:
    rows = [{"path": f"img/{i}.png", "label": i % 2, "class_name": name} for i, name in enumerate(names)]
    manifest = png_manifest(rows, header=("path", "label", "class_name"))
    with pytest.raises(DataError, match=expected):
        load_source(f"csv:{manifest}")


@pytest.mark.parametrize("encoding, separator", [("utf-8-sig", ","), ("utf-16", "\t"), ("cp1252", ",")])
def test_a_manifest_in_a_spreadsheets_encoding_reads_as_utf_8_does(png_manifest, tmp_path: Path, encoding: str,
                                                                   separator: str) -> None:
    """Spreadsheet programs write "CSV UTF-8" (a byte order mark), "Unicode text" (UTF-16, tab-separated) or
    Windows-1252 "CSV"; UTF-16 and Latin-1 manifests ended in a traceback (issue 49, item 7)."""
    rows = [{"path": f"img_{i}.png", "label": i % 2, "class_name": ("épanchement", "normal")[i % 2]}
            for i in range(40)]
    manifest = png_manifest(rows, header=("path", "label", "class_name"))
    expected = load_source(f"csv:{manifest}")
    text = manifest.read_text(encoding="utf-8").replace(",", separator)
    other = tmp_path / f"manifest-{encoding}.csv"
    other.write_bytes(text.encode(encoding))
    splits = load_source(f"csv:{other}")
    assert splits.info["class_names"] == expected.info["class_names"] == ["épanchement", "normal"]
    assert splits.train.paths == expected.train.paths and np.array_equal(splits.train.labels, expected.train.labels)
