"""Issue 61, items 1 and 2: every job names its classes (the data's, ``task.class_names``, or a placeholder every
site refuses); a site may hold a subset of them, numbered in the job's order, and leave an extra class out with
``class_map`` null."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from medflare.data import load_source, make_site_data
from medflare.data.classes import align_to_job, placeholder_class_names
from medflare.errors import DataError
from medflare.plan import resolve, task_of, validated
from medflare.run_config import RunConfig
from medflare.site_config import SiteFile, TaskSpec, typed_data_config
from medflare.site_runtime import SiteRuntime

JOB = ["effusion", "nodule", "normal"]  # the job's names, in label order
COUNTS = {"nodule": 15, "normal": 18}  # this site has no effusion images


def job_counts(image_sets) -> list[int]:
    labels = np.concatenate([image_set.labels for image_set in image_sets])
    return np.bincount(labels, minlength=len(JOB)).tolist()


@pytest.mark.parametrize("empty_folder", [False, True])
def test_a_site_missing_a_class_is_numbered_in_the_jobs_order_with_a_note(png_class_folder,
                                                                          empty_folder: bool) -> None:
    """No effusion/ folder, or an empty one: the site trains nodule and normal as the job's 1 and 2."""
    root = png_class_folder(COUNTS)
    if empty_folder:
        (root / "effusion").mkdir()
    splits = load_source(f"folder:{root}")
    assert splits.info["class_names"] == ["nodule", "normal"]  # an empty folder is no class of this site

    aligned = align_to_job(splits, JOB, None, "hospital-b")

    assert aligned.train.num_classes == 3 and aligned.info["class_names"] == JOB
    assert job_counts([aligned.train, aligned.val, aligned.test]) == [0, 15, 18]
    for path, label in zip(aligned.train.paths, aligned.train.labels):
        assert JOB[label] == Path(path).parent.name  # each image under its own folder's job number
    assert aligned.info["class_notes"] == [
        "hospital-b: this site holds no images of the job's class(es) effusion; it trains on the others, numbered "
        "in the job's order (add images of them to contribute them)"]


def test_a_class_the_job_lacks_is_refused_with_both_fixes(png_class_folder) -> None:
    splits = load_source(f"folder:{png_class_folder({**COUNTS, 'cardiomegaly': 4})}")
    with pytest.raises(DataError) as refused:
        align_to_job(splits, JOB, None, "hospital-b")
    message = str(refused.value)
    assert "\n" not in message and "['cardiomegaly', 'nodule', 'normal'] are not among the job's" in message
    assert '{"data": {"class_map": {"cardiomegaly": "<the job\'s name>"}}}' in message
    assert 'or leave a class out with {"cardiomegaly": null}' in message


def test_class_map_null_leaves_a_class_out_and_counts_its_images(png_class_folder) -> None:
    splits = load_source(f"folder:{png_class_folder({**COUNTS, 'cardiomegaly': 7})}")

    aligned = align_to_job(splits, JOB, {"cardiomegaly": None}, "hospital-b")

    sets = [aligned.train, aligned.val, aligned.test]
    assert sum(len(image_set) for image_set in sets) == 15 + 18
    assert not any("/cardiomegaly/" in path for image_set in sets for path in image_set.paths)
    assert job_counts(sets) == [0, 15, 18]
    assert aligned.info["class_notes"][0] == ("hospital-b: class_map leaves out cardiomegaly: 7 image(s) neither "
                                              "trained nor checked (map a class to one of the job's names to train "
                                              "on it)")
    with pytest.raises(DataError, match="class_map leaves out every class of this site"):
        align_to_job(splits, JOB, dict.fromkeys(["cardiomegaly", "nodule", "normal"]), "hospital-b")


def test_without_a_job_class_map_null_leaves_the_class_out_of_the_sites_own_view(png_class_folder) -> None:
    """Preflight's view of the site's own data: the kept classes in the site's order, renumbered 0..k-1."""
    splits = load_source(f"folder:{png_class_folder({**COUNTS, 'cardiomegaly': 7})}")
    own = align_to_job(splits, None, {"cardiomegaly": None}, "hospital-b")
    assert own.info["class_names"] == ["nodule", "normal"]
    assert np.bincount(own.train.labels).tolist() == np.bincount(splits.train.labels)[1:].tolist()


def test_unnamed_labels_in_the_jobs_ids_may_miss_a_class(png_manifest) -> None:
    """A CSV of job-order ids 0 and 2 only (it was refused): read with the job's 3 classes, id 1 named missing."""
    manifest = png_manifest([{"path": f"img_{i}.png", "label": (0, 2)[i % 2]} for i in range(24)])
    cfg = typed_data_config({"source": f"csv:{manifest}", "local": True, "num_sites": 1, "num_classes": 3})
    data = make_site_data(cfg, 0, "site-1", class_names=JOB)
    assert data.num_classes == 3 and data.class_counts[1] == 0 and data.class_counts[[0, 2]].min() > 0
    assert data.class_notes == ("site-1: this site holds no images of the job's class(es) nodule; it trains on the "
                                "others, numbered in the job's order (add images of them to contribute them)",)
    with pytest.raises(DataError, match=r"this site's labels go up to 2 but the job has 2 classes"):
        make_site_data(cfg, 0, "site-1", class_names=JOB[:2])


@pytest.mark.parametrize("source", ["synthetic:n=60,classes=2", "folder"])
def test_every_site_refuses_the_placeholder_saying_how_to_name_the_classes(png_class_folder, source: str) -> None:
    source = f"folder:{png_class_folder(COUNTS)}" if source == "folder" else source
    cfg = typed_data_config({"source": source, "local": True, "num_sites": 1})
    with pytest.raises(DataError) as refused:
        make_site_data(cfg, 0, "hospital-a", class_names=placeholder_class_names(2))
    assert str(refused.value).startswith("hospital-a: the job's class names are the placeholder ['<class 1>', "
                                         "'<class 2>']; the lead sets them in label order (--set 'task.class_names=")


def site_file(folder: Path, data: dict) -> SiteFile:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "medflare_site.json").write_text(json.dumps({"data": data}))
    return SiteFile.of(folder)


def deployed_runtime(task: dict, data: dict, folder: Path, log: Callable[[str], None]) -> SiteRuntime:
    """The site's runtime as the executor builds it from a site-data job's plan and the hospital's own file."""
    run = validated(RunConfig(method="fedavg", clients=1, data={"source": "site"}, task=task,
                              train={"max_steps": 1}))
    plan = resolve(run, "preinstalled", task=TaskSpec(**task))
    site = plan.sites[0].name
    settings, index = plan.localise(site, site_file(folder, data), simulated=False)
    return SiteRuntime(settings, site, index, log=log)


def test_a_deployed_site_missing_a_class_trains_and_its_log_names_the_class(png_class_folder, tmp_path) -> None:
    lines: list[str] = []
    task = {"num_classes": 3, "in_channels": 1, "image_size": 12, "class_names": JOB}
    runtime = deployed_runtime(task, {"source": f"folder:{png_class_folder(COUNTS)}"}, tmp_path, lines.append)
    assert runtime.data.num_classes == 3 and runtime.data.class_counts[0] == 0
    assert any("this site holds no images of the job's class(es) effusion" in line for line in lines), lines


def test_a_job_naming_no_classes_is_refused_where_the_data_names_them(png_class_folder, tmp_path) -> None:
    task = {"num_classes": 2, "in_channels": 1, "image_size": 12, "class_names": None}
    with pytest.raises(DataError) as refused:
        deployed_runtime(task, {"source": f"folder:{png_class_folder(COUNTS)}"}, tmp_path / "named", print)
    assert str(refused.value) == ("site-1: the job names no classes but this site's data names ['nodule', 'normal']; "
                                  "the lead adds them in label order (--set 'task.class_names=[...]') and exports "
                                  "the job again")
    unnamed = deployed_runtime(task, {"source": "synthetic:n=60,classes=2,size=12,channels=1"}, tmp_path / "npz",
                               lambda line: None)  # data without names: taken in the job's order, as before
    assert unnamed.data.num_classes == 2


def test_every_job_names_its_classes(png_class_folder) -> None:
    """Site data without names: the placeholder; data the lead points at: its names, even with a declared task."""
    declared = {"num_classes": 2, "in_channels": 1, "image_size": 28}
    site_run = validated(RunConfig(method="fedavg", data={"source": "site"}, task=declared), check_files=False)
    assert task_of(site_run).class_names == ["<class 1>", "<class 2>"]
    folder = png_class_folder(COUNTS)
    folder_run = validated(RunConfig(method="fedavg", data={"source": f"folder:{folder}"},
                                     task={**declared, "image_size": 12}))
    assert task_of(folder_run).class_names == ["nodule", "normal"]


def test_a_multi_label_site_missing_a_finding_leaves_its_column_not_annotated() -> None:
    from medflare.data.types import UNLABELED, DataSplits, ImageSet

    rows = np.array([[1, 0], [0, 1]])  # this site's columns: c, a
    image_set = ImageSet(labels=rows, num_classes=2, channels=1, images=np.zeros((2, 4, 4, 1), dtype=np.uint8))
    splits = DataSplits(train=image_set, val=image_set, test=image_set,
                        info={"class_names": ["c", "a"], "named_classes": True})
    aligned = align_to_job(splits, ["a", "b", "c"], None, "site-1")
    assert aligned.train.num_classes == 3
    assert aligned.train.labels.tolist() == [[0, UNLABELED, 1], [1, UNLABELED, 0]]  # a, b (unknown here), c
    assert "class(es) b" in aligned.info["class_notes"][0]
