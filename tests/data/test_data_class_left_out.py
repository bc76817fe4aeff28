"""Issue 61, item 2: ``"class_map": {"cardiomegaly": null}`` leaves a class out without reading its images (a
folder's class folder or a CSV's rows of that class_name are listed and counted, never opened), and a CSV whose
label ids follow the job's order may lack one of them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from medflare.data import load_source, make_site_data
from medflare.data.classes import align_to_job
from medflare.errors import DataError
from medflare.plan import resolve, validated
from medflare.run_config import RunConfig
from medflare.site_config import SiteFile, TaskSpec, typed_data_config
from medflare.site_runtime import SiteRuntime

JOB = ["effusion", "nodule", "normal"]  # the job's names, in label order
LEFT_OUT = 5  # cardiomegaly images at the site, which the job has no class for


def site_config(source: str, class_map: dict | None) -> object:
    return typed_data_config({"source": source, "local": True, "num_sites": 1, "class_map": class_map})


def unreadable(folder: Path, count: int) -> None:
    """``count`` files named like PNGs that no reader can decode: reading any of them fails."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"broken_{i}.png").write_bytes(b"not a png")


def test_a_left_out_class_folder_is_never_read(png_class_folder) -> None:
    root = png_class_folder({"nodule": 9, "normal": 12})
    unreadable(root / "cardiomegaly", LEFT_OUT)  # sorts first: the loader's first image, were it read
    with pytest.raises(DataError, match="cardiomegaly"):
        load_source(f"folder:{root}")  # read, the class fails the source

    data = make_site_data(site_config(f"folder:{root}", {"cardiomegaly": None}), 0, "site-1", class_names=JOB)

    assert data.class_names == tuple(JOB) and data.num_classes == 3
    assert data.class_counts[0] == 0 and data.class_counts[1:].min() > 0
    assert data.class_notes == (
        f"site-1: class_map leaves out cardiomegaly: {LEFT_OUT} image(s) neither trained nor checked (map a class "
        "to one of the job's names to train on it)",
        "site-1: this site holds no images of the job's class(es) effusion; it trains on the others, numbered in the "
        "job's order (add images of them to contribute them)")
    paths = [path for split in (data.train, data.val, data.test) for path in split.images.paths]
    assert len(paths) == 21 and not any("cardiomegaly" in path for path in paths)
    assert all(JOB[int(label)] == Path(path).parent.name
               for path, label in zip(data.train.images.paths, data.train.images.labels))


def test_a_left_out_class_name_of_a_csv_skips_its_rows_unchecked(png_manifest) -> None:
    rows = [{"path": f"img_{i}.png", "label": i % 2, "class_name": ("nodule", "normal")[i % 2]} for i in range(20)]
    rows += [{"path": f"missing_{i}.png", "label": 2, "class_name": "cardiomegaly"} for i in range(LEFT_OUT)]
    manifest = png_manifest(rows, header=("path", "label", "class_name"))
    with pytest.raises(DataError, match="missing_0.png' does not exist"):
        load_source(f"csv:{manifest}")  # its rows are checked when the class is kept

    splits = load_source(f"csv:{manifest}", left_out=["cardiomegaly"])
    aligned = align_to_job(splits, JOB, {"cardiomegaly": None}, "site-1")

    assert splits.info["left_out"] == {"cardiomegaly": LEFT_OUT}
    assert aligned.info["class_names"] == JOB
    assert aligned.info["class_notes"][0].startswith(f"site-1: class_map leaves out cardiomegaly: {LEFT_OUT} image(s)")


def test_a_csv_with_the_jobs_ids_and_names_may_lack_a_middle_class(png_manifest) -> None:
    """Labels 0 and 2 named effusion and normal: the site lacks nodule (1); its ids need no renumbering."""
    names = {0: "effusion", 2: "normal"}
    rows = [{"path": f"img_{i}.png", "label": (0, 2)[i % 2], "class_name": names[(0, 2)[i % 2]]} for i in range(24)]
    splits = load_source(f"csv:{png_manifest(rows, header=('path', 'label', 'class_name'))}")

    aligned = align_to_job(splits, JOB, None, "site-1")

    assert aligned.info["class_names"] == JOB and aligned.train.num_classes == 3
    labels = np.concatenate([aligned.train.labels, aligned.val.labels, aligned.test.labels])
    assert np.bincount(labels, minlength=3).tolist() == [12, 0, 12]
    assert aligned.info["class_notes"] == [
        "site-1: this site holds no images of the job's class(es) nodule; it trains on the others, numbered in the "
        "job's order (add images of them to contribute them)"]


def test_leaving_out_every_class_is_refused_in_one_line(png_class_folder: Callable[..., Path]) -> None:
    root = png_class_folder({"cardiomegaly": 4})
    with pytest.raises(DataError, match=r"class_map leaves out every class \(cardiomegaly\); keep at least one"):
        load_source(f"folder:{root}", left_out=["cardiomegaly"])


def test_a_job_naming_no_classes_is_refused_without_reading_a_left_out_class(png_class_folder, tmp_path) -> None:
    """The site's check of a job without names reads its source as the job would: the class_map null class unread,
    so the refusal is the one saying to add the names (not a broken file's), and it lists only the kept classes."""
    root = png_class_folder({"nodule": 9, "normal": 12})
    unreadable(root / "cardiomegaly", LEFT_OUT)
    task = {"num_classes": 2, "in_channels": 1, "image_size": 12, "class_names": None}
    run = validated(RunConfig(method="fedavg", clients=1, data={"source": "site"}, task=task, train={"max_steps": 1}))
    plan = resolve(run, "preinstalled", task=TaskSpec(**task))
    site = plan.sites[0].name
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "medflare_site.json").write_text(json.dumps(
        {"data": {"source": f"folder:{root}", "class_map": {"cardiomegaly": None}}}))
    settings, index = plan.localise(site, SiteFile.of(tmp_path / "local"), simulated=False)

    with pytest.raises(DataError, match=re.escape("site-1: the job names no classes but this site's data names "
                                                  "['nodule', 'normal']")):
        SiteRuntime(settings, site, index, log=lambda line: None)
