"""Patients stay in one split: a CT-like series of several slices per patient (DICOM, flat or in patient folders)
and a CSV's patient_id column are split so that no patient has images in two of train/val/test."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from medflare.data import load_source
from medflare.data.sources import PATIENT_FOLDER, grouped_split, stratified_split
from medflare.errors import ConfigError, DataError

from .test_data_readers import hounsfield_image, pydicom, write_dicom

SPLITS = ("train", "val", "test")
CLASSES = ("hemorrhage", "normal")
FRACTIONS = (0.70, 0.15, 0.15)


def ct_series(root: Path, patients: int, slices: int, layout: str) -> Path:
    """``patients`` per class, ``slices`` each: flat (<class>/<patient>_<slice>.dcm with a PatientID), flat with only a
    StudyInstanceUID, or nested (<class>/<patient>/<slice>.dcm; a PatientID too, which the check reads back)."""
    for label, name in enumerate(CLASSES):
        for patient in range(patients):
            patient_id = f"{name[:3]}-{patient:02d}"
            tags = {"StudyInstanceUID": f"1.2.826.0.1.{label}.{patient}"} if layout == "study" else \
                {"PatientID": patient_id, "StudyInstanceUID": f"1.2.826.0.1.{label}.{patient}"}
            for index in range(slices):
                where = f"{name}/{patient_id}/{index}.dcm" if layout == "nested" else f"{name}/{patient_id}_{index}.dcm"
                write_dicom(root / where, hounsfield_image([index * 10]), tags=tags)
    return root


def patients_in(split_paths: list[str], tag: str) -> set[str]:
    """The patients of a split as the files say (their header, read back with pydicom)."""
    return {str(getattr(pydicom.dcmread(path, stop_before_pixels=True), tag)) for path in split_paths}


@pytest.mark.parametrize(("layout", "key", "tag"), [("flat", "PatientID", "PatientID"),
                                                     ("study", "StudyInstanceUID", "StudyInstanceUID"),
                                                     ("nested", "PatientID", "PatientID")])
def test_a_ct_series_splits_with_no_patient_in_two_splits(tmp_path: Path, layout: str, key: str, tag: str) -> None:
    root = ct_series(tmp_path / "ct", patients=10, slices=4, layout=layout)
    splits = load_source(f"folder:{root}", seed=3)
    paths = {split: getattr(splits, split).paths for split in SPLITS}
    assert sum(len(found) for found in paths.values()) == 2 * 10 * 4  # nested files are found too
    seen = {split: patients_in(paths[split], tag) for split in SPLITS}
    assert not (seen["train"] & seen["val"]) and not (seen["train"] & seen["test"]) and not (seen["val"] & seen["test"])
    assert splits.info["grouping"] == {"key": key, "groups": {split: len(seen[split]) for split in SPLITS},
                                       "shared": 0, "note": ""}
    assert [len(seen[split]) for split in SPLITS] == [14, 3, 3]  # 20 patients, near 70/15/15
    assert set(splits.train.labels.tolist()) == {0, 1}
    assert all(len(paths[split]) == 4 * len(seen[split]) for split in SPLITS)  # every slice with its patient


def test_series_folders_of_one_patient_are_one_patient(tmp_path: Path) -> None:
    """An export with one folder per series (<class>/<series>/*.dcm): the header's PatientID, not the folder, is
    the patient, so a patient's two series never sit in train and test."""
    for name in CLASSES:
        for patient in range(10):
            for series in ("axial", "coronal"):
                for index in range(2):
                    write_dicom(tmp_path / "ct" / name / f"{name}-{patient}-{series}" / f"{index}.dcm",
                                hounsfield_image([index]), tags={"PatientID": f"{name}-{patient}"})
    splits = load_source(f"folder:{tmp_path / 'ct'}", seed=0)
    seen = {split: patients_in(getattr(splits, split).paths, "PatientID") for split in SPLITS}
    assert not (seen["train"] & seen["val"]) and not (seen["train"] & seen["test"]) and not (seen["val"] & seen["test"])
    assert splits.info["grouping"]["key"] == "PatientID" and [len(seen[split]) for split in SPLITS] == [14, 3, 3]


def test_the_patient_split_is_seeded(tmp_path: Path) -> None:
    root = ct_series(tmp_path / "ct", patients=10, slices=2, layout="flat")
    first = load_source(f"folder:{root}", seed=1).test.paths
    assert load_source(f"folder:{root}", seed=1).test.paths == first
    assert load_source(f"folder:{root}", seed=2).test.paths != first


def test_split_folders_that_share_a_patient_are_counted(tmp_path: Path) -> None:
    for split in SPLITS:
        for name in CLASSES:
            for patient in ("p1", f"{split}-only"):
                write_dicom(tmp_path / "ct" / split / name / patient / "0.dcm", hounsfield_image([0]))
    grouping = load_source(f"folder:{tmp_path / 'ct'}").info["grouping"]
    assert grouping == {"key": PATIENT_FOLDER, "groups": dict.fromkeys(SPLITS, 2), "shared": 1, "note": ""}


def test_a_csv_of_dicoms_without_a_patient_column_splits_by_their_patient_id(tmp_path: Path) -> None:
    root = ct_series(tmp_path / "ct", patients=10, slices=3, layout="flat")
    files = sorted(root.rglob("*.dcm"))
    manifest = tmp_path / "ct.csv"
    manifest.write_text("path,label\n" + "".join(f"{path},{CLASSES.index(path.parent.name)}\n" for path in files))
    splits = load_source(f"csv:{manifest}", seed=0)
    seen = {split: patients_in(getattr(splits, split).paths, "PatientID") for split in SPLITS}
    assert not (seen["train"] & seen["val"]) and not (seen["train"] & seen["test"]) and not (seen["val"] & seen["test"])
    assert splits.info["grouping"]["key"] == "PatientID" and [len(seen[split]) for split in SPLITS] == [14, 3, 3]


def test_a_csv_patient_id_column_keeps_each_patients_rows_in_one_split(png_manifest: Callable[..., Path]) -> None:
    rows = [{"path": f"img/{label}_{patient}_{index}.png", "label": label, "patient_id": f"P{label}{patient}"}
            for label in (0, 1) for patient in range(10) for index in range(3)]
    manifest = png_manifest(rows, header=("path", "label", "patient_id"))
    splits = load_source(f"csv:{manifest}", seed=0)
    patient_of = {str(manifest.parent / row["path"]): row["patient_id"] for row in rows}
    seen = {split: {patient_of[path] for path in getattr(splits, split).paths} for split in SPLITS}
    assert not (seen["train"] & seen["val"]) and not (seen["train"] & seen["test"]) and not (seen["val"] & seen["test"])
    assert [len(seen[split]) for split in SPLITS] == [14, 3, 3]
    assert splits.info["grouping"]["key"] == "patient_id column" and splits.info["grouping"]["shared"] == 0
    assert set(splits.test.patients) == seen["test"]  # the set carries its patients


def test_without_a_patient_key_each_image_is_split_alone(png_class_folder: Callable[..., Path]) -> None:
    splits = load_source(f"folder:{png_class_folder({'a': 20, 'b': 20})}")
    assert splits.info["grouping"] == {"key": None, "groups": None, "shared": None, "note": ""}
    assert splits.train.patients is None


def test_too_few_patients_split_by_image_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    labels = np.repeat([0, 1], 10)
    with caplog.at_level(logging.WARNING):
        parts, note = grouped_split(labels, np.array(["a"] * 10 + ["b"] * 10, dtype=object), seed=0)
    assert [part.tolist() for part in parts] == [part.tolist() for part in stratified_split(labels, FRACTIONS, 0)]
    assert note.startswith("only 2 patient(s), too few to keep each in one of 3 splits") and "add patients" in note
    assert [record.getMessage() for record in caplog.records] == [f"medflare: {note}"]


def test_every_class_keeps_a_patient_in_train(tmp_path: Path) -> None:
    """Three patients of a rare class: the split may deal none of them to train; one is then moved there."""
    labels = np.array([0] * 40 + [1] * 3)
    patients = np.array([f"c{i // 2}" for i in range(40)] + ["r0", "r1", "r2"], dtype=object)
    for seed in range(10):
        parts, _ = grouped_split(labels, patients, seed)
        assert 1 in labels[parts[0]]
        owners = [set(patients[part]) for part in parts]
        assert not (owners[0] & owners[1]) and not (owners[0] & owners[2]) and not (owners[1] & owners[2])
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))


def test_data_patient_column_names_another_csv_column(png_manifest: Callable[..., Path]) -> None:
    rows = [{"path": f"img/{label}_{patient}_{index}.png", "label": label, "PatientID": f"P{label}{patient}"}
            for label in (0, 1) for patient in range(10) for index in range(2)]
    manifest = png_manifest(rows, header=("path", "label", "PatientID"))
    assert load_source(f"csv:{manifest}").info["grouping"]["key"] is None  # not the default column
    splits = load_source(f"csv:{manifest}", patient_column="PatientID")
    assert splits.info["grouping"] == {"key": "PatientID column", "groups": dict(zip(SPLITS, (14, 3, 3))),
                                       "shared": 0, "note": ""}
    with pytest.raises(DataError, match=r"has no column 'patient' \(data.patient_column\); name one of its columns: "
                                        "path,label,PatientID"):
        load_source(f"csv:{manifest}", patient_column="patient")


def test_data_patient_column_on_a_folder_source_is_refused(png_class_folder: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError, match="names a CSV manifest's column, but the source 'folder:.*' is not a CSV"):
        load_source(f"folder:{png_class_folder({'a': 3, 'b': 3})}", patient_column="PatientID")
