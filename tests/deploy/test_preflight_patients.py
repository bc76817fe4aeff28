"""Preflight's patients row as a hospital admin reads it: patients per split, and a WARN saying what the site can do
when a patient's images are in two splits or, for slices, no patient key is known."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from medflare.console.deploy.preflight import PASS, WARN, preflight

from ..data.test_data_readers import hounsfield_image, write_dicom
from . import test_preflight
from .test_preflight import statuses

CLASSES = ("hemorrhage", "normal")
# test_preflight's fixtures: hospital-a's provisioned kit, with 28x28 PNGs in <class>/ folders
provisioned, kit = test_preflight.provisioned, test_preflight.kit


def with_data(kit: Path, source: Path) -> Path:
    (kit / "local" / "medflare_site.json").write_text(json.dumps({"data": {"source": f"folder:{source}"}}))
    return kit


def patients_row(kit: Path) -> tuple[str, str]:
    return statuses(preflight(kit, server=False, progress=lambda line: None))["patients"]


def test_a_ct_series_in_patient_folders_reports_patients_per_split(kit: Path, tmp_path: Path) -> None:
    for name in CLASSES:
        for patient in range(10):
            for index in range(3):
                write_dicom(tmp_path / "ct" / name / f"{name}-{patient}" / f"{index}.dcm", hounsfield_image([index]))
    assert patients_row(with_data(kit, tmp_path / "ct")) == (
        PASS, "by folder <class>/<patient>/: 14/3/3 patients (train/val/test), none in two splits")


def test_a_patient_in_two_split_folders_is_a_warn_saying_what_to_do(kit: Path, tmp_path: Path) -> None:
    for split in ("train", "val", "test"):
        for name in CLASSES:
            for patient in ("anna", f"{split}-{name}"):
                write_dicom(tmp_path / "ct" / split / name / patient / "0.dcm", hounsfield_image([0]))
    assert patients_row(with_data(kit, tmp_path / "ct")) == (
        WARN, "by folder <class>/<patient>/: 3/3/3 patients (train/val/test); 1 patient(s) in more than one split "
              "(anna): a split folder or the CSV's split column puts them there: move each patient's images into "
              "one split, or drop the split folders/column so medflare splits by patient")


def test_slices_without_a_patient_key_are_a_warn(kit: Path, tmp_path: Path) -> None:
    for name in CLASSES:
        for index in range(6):
            write_dicom(tmp_path / "ct" / name / f"{index}.dcm", hounsfield_image([index]))  # no PatientID, no UID
    assert patients_row(with_data(kit, tmp_path / "ct")) == (
        WARN, "no patient key: each image is split alone, so one patient's images may be in train and test; put "
              "each patient's files in <class>/<patient>/ folders (or give the DICOMs a PatientID), or add a "
              "patient_id column to the CSV (these are slices: test metrics are optimistic)")


def test_photos_without_a_patient_key_pass_with_the_hint(kit: Path) -> None:
    status, detail = patients_row(kit)  # the kit's own 28x28 PNGs in <class>/ folders
    assert status == PASS and detail.startswith("no patient key: each image is split alone")


def test_the_site_files_patient_column_is_the_key_preflight_reports(kit: Path, tmp_path: Path) -> None:
    lines = ["path,label,PatientID"]
    rng = np.random.default_rng(0)
    for label in (0, 1):
        for patient in range(10):
            for index in range(2):
                name = f"img/{label}_{patient}_{index}.png"
                (tmp_path / "img").mkdir(exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(tmp_path / name)
                lines.append(f"{name},{label},P{label}{patient}")
    (tmp_path / "manifest.csv").write_text("\n".join(lines) + "\n")
    (kit / "local" / "medflare_site.json").write_text(json.dumps(
        {"data": {"source": f"csv:{tmp_path / 'manifest.csv'}", "patient_column": "PatientID"}}))
    assert patients_row(kit) == (PASS, "by PatientID column: 14/3/3 patients (train/val/test), none in two splits")
