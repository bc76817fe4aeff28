"""The data contract's class names: a site whose data names its classes must name the job's, in one line that lists
both; its own ``class_map`` renumbers its labels into the job's order."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from medflare.data import load_source
from medflare.data.classes import align_to_job, class_names_refusal
from medflare.data.types import UNLABELED, DataSplits, ImageSet
from medflare.errors import ConfigError, DataError
from medflare.plan import resolve, task_of, validated
from medflare.run_config import RunConfig
from medflare.site_config import SiteFile, TaskSpec
from medflare.site_runtime import SiteRuntime

JOB = ["effusion", "nodule", "normal"]  # the job's names, in label order (sorted, as the lead's folders gave them)
COUNTS = {"effusion": 12, "nodule": 15, "normal": 18}  # a different count per class: a label's class shows in it


def hospital(png_class_folder: Callable[..., Path], spelling: dict[str, str]) -> str:
    """A hospital's folder source: the job's classes, some folders spelled its own way."""
    root = png_class_folder({spelling.get(name, name): count for name, count in COUNTS.items()})
    return f"folder:{root}"


def counts_by_job_class(splits: DataSplits) -> list[int]:
    labels = np.concatenate([splits.train.labels, splits.val.labels, splits.test.labels])
    return np.bincount(labels, minlength=len(JOB)).tolist()


def test_a_site_that_spells_a_class_differently_is_refused_listing_both(png_class_folder) -> None:
    splits = load_source(hospital(png_class_folder, {"normal": "Normal"}))
    assert splits.info["class_names"] == ["Normal", "effusion", "nodule"]  # what the sorted folders number

    with pytest.raises(DataError) as refused:
        align_to_job(splits, JOB, None, "hospital-b")

    message = str(refused.value)
    assert "\n" not in message and message.startswith("hospital-b: ")
    assert "['Normal', 'effusion', 'nodule']" in message and "['effusion', 'nodule', 'normal']" in message
    assert '"class_map": {"Normal": ' in message  # the fix, with the name to map


def test_class_map_renumbers_the_labels_into_the_jobs_order(png_class_folder) -> None:
    splits = load_source(hospital(png_class_folder, {"normal": "Normal"}))
    assert counts_by_job_class(splits) == [18, 12, 15]  # Normal=0, effusion=1, nodule=2 as loaded

    aligned = align_to_job(splits, JOB, {"Normal": "normal"}, "hospital-b")

    assert aligned.info["class_names"] == JOB
    assert counts_by_job_class(aligned) == [12, 15, 18]  # each image keeps its class, under the job's number
    normal_folder = [label for path, label in zip(aligned.train.paths, aligned.train.labels) if "/Normal/" in path]
    assert normal_folder and set(normal_folder) == {JOB.index("normal")}


def test_the_same_names_keep_the_loaded_splits(png_class_folder) -> None:
    splits = load_source(hospital(png_class_folder, {}))
    assert align_to_job(splits, JOB, None, "hospital-a") is splits
    assert align_to_job(splits, None, None, "hospital-a") is splits  # a job that names no classes checks nothing


@pytest.mark.parametrize("class_map, expected", [
    ({"Abnormal": "normal"}, "class_map names ['Abnormal'], which are not among this site's classes"),
    ({"Normal": "effusion"}, "class_map makes two of this site's classes one"),
])
def test_a_class_map_that_cannot_be_right_is_refused(png_class_folder, class_map: dict, expected: str) -> None:
    splits = load_source(hospital(png_class_folder, {"normal": "Normal"}))
    with pytest.raises(DataError, match=re.escape(expected)):
        align_to_job(splits, JOB, class_map, "hospital-b")


def test_unnamed_data_is_taken_in_the_jobs_order_and_refuses_a_class_map() -> None:
    splits = load_source("synthetic:n=60,classes=3")
    assert not splits.info.get("named_classes")
    assert align_to_job(splits, JOB, None, "site-1") is splits
    with pytest.raises(DataError, match="class_map is set, but the data names no classes"):
        align_to_job(splits, JOB, {"a": "b"}, "site-1")


def named(labels: np.ndarray, names: list[str]) -> DataSplits:
    image_set = ImageSet(labels=labels, num_classes=len(names), channels=1, images=np.zeros((len(labels), 4, 4, 1),
                                                                                          dtype=np.uint8))
    return DataSplits(train=image_set, val=image_set, test=image_set,
                      info={"class_names": names, "named_classes": True})


def test_unlabelled_images_stay_unlabelled_and_multi_label_columns_move() -> None:
    single = align_to_job(named(np.array([0, UNLABELED, 2, 1]), ["c", "a", "b"]), ["a", "b", "c"], None, "s")
    assert single.train.labels.tolist() == [2, UNLABELED, 1, 0]

    rows = np.array([[1, 0, -1], [0, 1, 1]])  # columns c, a, b; -1 = not annotated
    multi = align_to_job(named(rows, ["c", "a", "b"]), ["a", "b", "c"], None, "s")
    assert multi.train.labels.tolist() == [[0, -1, 1], [1, 1, 0]]  # columns a, b, c


def site_file(folder: Path, data: dict) -> SiteFile:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "medflare_site.json").write_text(json.dumps({"data": data}))
    return SiteFile.of(folder)


def test_a_deployed_site_refuses_the_job_or_trains_in_its_order_with_class_map(png_class_folder, tmp_path) -> None:
    """The site's runtime, built as the executor builds it from the job's plan and the hospital's own file."""
    task = {"num_classes": 3, "in_channels": 1, "image_size": 12, "class_names": JOB}
    run = RunConfig(method="fedavg", clients=1, data={"source": "site"}, task=task, train={"max_steps": 1})
    run = validated(run)
    plan = resolve(run, "preinstalled", task=TaskSpec(**task))
    source = hospital(png_class_folder, {"normal": "Normal"})
    site = plan.sites[0].name

    settings, index = plan.localise(site, site_file(tmp_path / "plain", {"source": source}), simulated=False)
    with pytest.raises(DataError, match=r"this site's classes \['Normal', 'effusion', 'nodule'\] are not among the job's"):
        SiteRuntime(settings, site, index, log=lambda line: None)

    mapped = site_file(tmp_path / "mapped", {"source": source, "class_map": {"Normal": "normal"}})
    settings, index = plan.localise(site, mapped, simulated=False)
    runtime = SiteRuntime(settings, site, index, log=lambda line: None)
    assert runtime.data.class_counts.tolist()[JOB.index("normal")] == max(runtime.data.class_counts)


def test_a_job_cannot_set_a_sites_class_map(png_class_folder, tmp_path) -> None:
    task = {"num_classes": 3, "in_channels": 1, "image_size": 12, "class_names": JOB}
    run = RunConfig(method="fedavg", clients=1, data={"source": "site", "class_map": {"Normal": "effusion"}},
                    task=task, train={"max_steps": 1})
    plan = resolve(run, "preinstalled", task=TaskSpec(**task))
    with pytest.raises(DataError, match="class_map"):
        plan.localise(plan.sites[0].name, site_file(tmp_path, {"source": hospital(png_class_folder, {})}), False)


ODEM_NFC, ODEM_NFD = "\u00d6dem", "O\u0308dem"  # "Ödem" composed (a plan, Windows, Linux) and decomposed (macOS)


def test_a_site_whose_folder_spells_a_class_in_another_unicode_form_trains_under_the_jobs_name(png_class_folder) -> None:
    """Issue 60, item 8: a hospital's macOS-written folder "Ödem" (NFD) was refused against the job's "Ödem" (NFC)
    in a line that printed both identically; the names are one in NFC, so the site's data is the job's."""
    job = [ODEM_NFC, "normal"]
    splits = load_source(f"folder:{png_class_folder({ODEM_NFD: 6, 'normal': 9})}")
    assert splits.info["class_names"] == [ODEM_NFD, "normal"]

    aligned = align_to_job(splits, job, None, "hospital-b")

    assert aligned.info["class_names"] == job
    assert np.array_equal(aligned.train.labels, splits.train.labels)  # same order: each image keeps its class
    mapped = align_to_job(splits, job, {ODEM_NFC: ODEM_NFD}, "hospital-b")  # a class_map key in either form
    assert mapped.info["class_names"] == job


@pytest.mark.parametrize("names, refused", [
    ([ODEM_NFC, ODEM_NFD, "normal"], "task.class_names: '\\xd6dem' and 'O\\u0308dem' are one class name in Unicode NFC"),
    (["normal", "\u202elamron", "nodule"], "task.class_names: the class name '\\u202elamron' holds U+202E"),
    (["normal", "nod\u2067ule", "x"], "holds U+2067 (a control, invisible or right-to-left character"),
    (["normal", "nor\u200bmal", "x"], "'nor\\u200bmal' holds U+200B"),  # looks like "normal"
    (["normal", "tab\there", "x"], "holds U+0009"),
])
def test_class_names_a_hospital_cannot_tell_apart_are_refused_in_one_line(names: list[str], refused: str) -> None:
    """Issue 60, item 8: two spellings of one name, or a right-to-left override (which reached report.md raw), in the
    job's class names: one line, the names escaped so that the two spellings print differently."""
    task = {"num_classes": 3, "in_channels": 1, "image_size": 12, "class_names": names}
    with pytest.raises(ConfigError) as error:
        validated(RunConfig(method="fedavg", clients=1, data={"source": "site"}, task=task))
    message = str(error.value)
    assert refused in message and "\n" not in message and "\u202e" not in message
    assert not class_names_refusal(["\u0645\u06cc\u200c\u0634\u0648\u062f", "normal", "x"])  # a Persian joiner is no trick


def test_a_data_folder_whose_name_holds_a_right_to_left_override_is_refused_before_the_job(png_class_folder) -> None:
    """The names a simulated job takes from its data source are held to the same check as declared ones."""
    source = "folder:" + str(png_class_folder({"normal": 6, "\u202elamron": 6}))
    with pytest.raises(ConfigError) as error:
        task_of(validated(RunConfig(method="fedavg", clients=1, data={"source": source})))
    message = str(error.value)
    assert f"the data '{source}': the class name '\\u202elamron' holds U+202E" in message and "\u202e" not in message
