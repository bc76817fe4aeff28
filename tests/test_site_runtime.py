"""The site side without FLARE: where data comes from, and when evaluation counts are sent."""

import dataclasses
import json
import re
import typing
from pathlib import Path

import numpy as np
import pytest

from medflare.data import DataConfig
from medflare.errors import ConfigError, DataError
from medflare.methods.base import RoundContext
from medflare.registry import get_method
from medflare.site_config import (
    DP_FILTER_ARGS,
    JOB_SETTABLE_DATA_KEYS,
    SITE_FIXED_DATA,
    SITE_ONLY_DATA_KEYS,
    SiteSettings,
    TaskSpec,
    check_dp_filter,
    read_site_data_config,
    site_index_from_name,
)
from medflare.site_runtime import SiteRuntime

TASK = TaskSpec(num_classes=5, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=200", "partition": "iid", "num_sites": 2}
EVAL_KEYS = {"eval_val", "eval_test", "eval_test_by_attribute"}


def test_simulation_data_comes_from_the_job() -> None:
    assert read_site_data_config("/nonexistent", DATA, simulated=True) == DATA


def test_a_real_site_refuses_data_the_job_names(tmp_path: Path) -> None:
    """POC/production: the job cannot choose what a site reads, with or without a site file."""
    with pytest.raises(DataError, match="refused: the job names its own data"):
        read_site_data_config(tmp_path, DATA)  # no site file
    (tmp_path / "medflare_site.json").write_text(json.dumps({"data": {"source": "folder:/data/xray"}}))
    for job_data in (DATA, {"source": "folder:/etc"}):
        for simulated in (False, True):  # a site's own file wins even in the simulator
            with pytest.raises(DataError, match="allow_job_data"):
                read_site_data_config(tmp_path, job_data, simulated=simulated)


def test_a_site_may_opt_in_to_job_data(tmp_path: Path) -> None:
    (tmp_path / "medflare_site.json").write_text(json.dumps({"allow_job_data": "yes"}))  # only true opts in
    with pytest.raises(DataError, match="refused"):
        read_site_data_config(tmp_path, DATA)
    (tmp_path / "medflare_site.json").write_text(json.dumps({"allow_job_data": True}))
    assert read_site_data_config(tmp_path, DATA) == DATA
    with pytest.raises(DataError, match="no 'data' object"):  # opted in, but the job asks for site data
        read_site_data_config(tmp_path, {"source": "site"})


@pytest.mark.parametrize("data", [{}, {"source": ""}, {"source": None}, {"image_size": 64}])
def test_a_site_file_whose_data_names_no_source_is_refused_not_trained_on_synthetic_images(
    tmp_path: Path, data: dict
) -> None:
    """DataConfig's default source is medflare's synthetic generator: a hospital's {"data": {}} trained on it,
    logging "2400 train images" (issue 49, item 3)."""
    (tmp_path / "medflare_site.json").write_text(json.dumps({"data": data}))
    with pytest.raises(DataError) as refused:
        read_site_data_config(tmp_path, {"source": "site"})
    assert str(refused.value).startswith(f"{tmp_path / 'medflare_site.json'}: its 'data' object names no source")


def test_site_data_comes_from_the_sites_own_file(tmp_path: Path) -> None:
    (tmp_path / "medflare_site.json").write_text(json.dumps({"data": {"source": "folder:/data/xray"}}))
    config = read_site_data_config(tmp_path, {"source": "site", "image_size": 32})
    assert config == {"image_size": 32, "source": "folder:/data/xray", "local": True, "num_sites": 1}


HOSTILE = "folder:/data/hospital-a/other-private-study"


@pytest.mark.parametrize("job_data", [
    {"source": "site", "public_source": HOSTILE},  # MDH-FL would send predictions on it to the server
    {"source": "site", "augment": "weak", "public_source": HOSTILE},  # an allowed key does not carry it in
    {"source": "site", "public_fraction": 0.5},
    {"source": "site", "identified": [0]},
    {"source": "site", "manifest": "/data/hospital-a/other.csv"},  # a key DataConfig does not even know
])
def test_a_job_cannot_set_data_keys_only_the_site_sets(tmp_path: Path, job_data: dict) -> None:
    """Refused, not dropped: the job's author learns the key had no effect."""
    (tmp_path / "medflare_site.json").write_text(json.dumps({"data": {"source": "folder:/data/xray"}}))
    refused = next(key for key in job_data if key not in ("source", "augment"))
    with pytest.raises(DataError, match=rf"refused: the job sets data key\(s\) {refused}, .*medflare_site\.json"):
        read_site_data_config(tmp_path, job_data)


def test_the_sites_own_public_source_is_used_and_wins_over_the_jobs(tmp_path: Path) -> None:
    site = {"source": "folder:/data/xray", "public_source": "images:/data/public"}
    (tmp_path / "medflare_site.json").write_text(json.dumps({"data": site}))
    for job_data in ({"source": "site"}, {"source": "site", "public_source": HOSTILE}):
        assert read_site_data_config(tmp_path, job_data) == {**site, "local": True, "num_sites": 1}


def test_job_settable_keys_and_what_job_templates_send_pass_through(tmp_path: Path) -> None:
    from job_templates import template_plan

    site_file = tmp_path / "medflare_site.json"
    site_file.write_text(json.dumps({"data": {"source": "folder:/data/xray"}}))
    template = template_plan("fedavg").data  # what a job made from a template sends: {"source": "site"}
    assert read_site_data_config(tmp_path, template) == {**template, "source": "folder:/data/xray", "local": True,
                                                          "num_sites": 1}
    site_file.write_text(json.dumps({"data": {"source": "folder:/data/xray", "seed": 4}}))
    job_data = {"source": "site", "augment": "weak", "window": "brain", "seed": 9, "num_sites": 3, "local": False}
    assert read_site_data_config(tmp_path, job_data) == {  # the site's seed wins; medflare fixes local, num_sites
        "augment": "weak", "window": "brain", "source": "folder:/data/xray", "seed": 4, "local": True, "num_sites": 1}


def test_an_opted_in_site_takes_every_data_key_of_the_job(tmp_path: Path) -> None:
    (tmp_path / "medflare_site.json").write_text(json.dumps({"allow_job_data": True, "data": {"source": "folder:/x"}}))
    config = read_site_data_config(tmp_path, {"source": "site", "public_source": "images:/shared/public"})
    assert config == {"public_source": "images:/shared/public", "source": "folder:/x", "local": True, "num_sites": 1}
    assert read_site_data_config(tmp_path, DATA) == DATA


PATH_HINTS = ("source", "path", "dir", "file", "root", "manifest", "folder", "npz", "csv")
# str fields reviewed as never naming a file: each is parsed against a fixed vocabulary (see DataConfig).
NON_PATH_STRINGS = {"partition", "eval_split", "noise_kind", "augment", "window"}


def test_every_data_field_is_classified_and_no_path_is_job_settable() -> None:
    """A new DataConfig field fails here until it is put in JOB_SETTABLE_DATA_KEYS or SITE_ONLY_DATA_KEYS."""
    fields = {field.name: field for field in dataclasses.fields(DataConfig)}
    hints = typing.get_type_hints(DataConfig)
    groups = [JOB_SETTABLE_DATA_KEYS, SITE_ONLY_DATA_KEYS, set(SITE_FIXED_DATA)]
    assert sorted(name for group in groups for name in group) == sorted(fields), (
        "put each DataConfig field in exactly one of JOB_SETTABLE_DATA_KEYS, SITE_ONLY_DATA_KEYS, SITE_FIXED_DATA")
    for name in JOB_SETTABLE_DATA_KEYS:
        takes_text = str in _leaf_types(hints[name]) or isinstance(fields[name].default, str)
        assert not any(hint in name for hint in PATH_HINTS), name
        assert not takes_text or name in NON_PATH_STRINGS, f"review whether data.{name} can name a file"
    assert {"source", "public_source"} <= SITE_ONLY_DATA_KEYS


def _leaf_types(hint: object) -> set[object]:
    """The plain types a type hint admits (``str | None`` -> {str, NoneType}; ``Literal["a"]`` -> {str})."""
    if typing.get_origin(hint) is typing.Literal:
        return {type(value) for value in typing.get_args(hint)}
    args = typing.get_args(hint)
    return set().union(*(_leaf_types(arg) for arg in args)) if args else {typing.get_origin(hint) or hint}


def test_missing_site_file_says_what_to_create(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="medflare_site.json"):
        read_site_data_config(tmp_path, {"source": "site"})
    (tmp_path / "medflare_site.json").write_text("{not json")
    with pytest.raises(DataError, match="JSON"):
        read_site_data_config(tmp_path, None)


def test_site_index_from_job_list_or_name() -> None:
    assert site_index_from_name("hospital-b", ["hospital-a", "hospital-b"]) == 1
    assert site_index_from_name("site-3", None) == 2
    with pytest.raises(ConfigError):
        site_index_from_name("hospital-c", ["hospital-a"])


@pytest.mark.parametrize("mode, in_train, in_validate", [("every_round", True, True), ("final", False, True), ("off", False, False)])
def test_evaluation_modes(mode: str, in_train: bool, in_validate: bool) -> None:
    settings = SiteSettings(get_method("fedavg"), TASK, DATA, train={"max_steps": 1}, evaluation=mode)
    runtime = SiteRuntime(settings, "site-1", 0, log=lambda m: None)
    _, train_meta = runtime.train({}, RoundContext(0, 1))
    assert (EVAL_KEYS <= set(train_meta)) is in_train and (not EVAL_KEYS & set(train_meta)) is not in_train
    assert (EVAL_KEYS <= set(runtime.validate({}))) is in_validate


def test_unknown_evaluation_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="evaluation"):
        SiteSettings(get_method("fedavg"), TASK, DATA, evaluation="sometimes")


def test_channel_mismatch_names_the_site() -> None:
    with pytest.raises(DataError, match="site-1.*in_channels=1"):
        SiteRuntime(SiteSettings(get_method("fedavg"), TaskSpec(5, 1, 28), DATA), "site-1", 0, log=lambda m: None)


def test_job_stage_overrides_merge_into_the_method_stage_defaults() -> None:
    """A job changing one option of one stage keeps the method's other options of that stage."""
    from medflare.registry import get_method
    from medflare.site_config import resolve_train_config

    cfg = resolve_train_config(get_method("fed-mae"), {"lr": 1e-3, "stages": {"pretrain": {"warmup_rounds": 3}}})
    pretrain = cfg.for_stage("pretrain")
    assert (pretrain.warmup_rounds, pretrain.betas, pretrain.lr) == (3, (0.9, 0.95), 2e-3)
    assert cfg.lr == 1e-3 and cfg.for_stage("finetune").betas == (0.9, 0.999)


def test_a_train_task_records_where_its_time_went_in_the_site_log(tmp_path: Path) -> None:
    """The spans of a train task (never sent) land in the site's own log; together they are the task's time."""
    import time

    from medflare.site_runtime import SITE_LOG_FILE, TASK_SECONDS_EVENT

    runtime = SiteRuntime(SiteSettings(get_method("fedavg"), TASK, DATA, train={"max_steps": 2}), "site-1", 0, log=lambda m: None,
                          local_dir=tmp_path)
    started = time.perf_counter()
    _, meta = runtime.train({}, RoundContext(3, 5))
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (tmp_path / SITE_LOG_FILE).read_text().splitlines()]
    spans = next(r for r in records if r.get("event") == TASK_SECONDS_EVENT)
    assert spans["round"] == 3
    assert set(spans["seconds"]) == {"evaluate", "receive", "train", "encode", "save_state"}
    assert all(seconds >= 0 for seconds in spans["seconds"].values())
    assert spans["seconds"]["train"] >= meta["train_seconds"]  # the trainer's own clock sits inside the span
    assert 0.9 * wall <= sum(spans["seconds"].values()) <= wall


def test_the_site_state_is_written_while_the_result_travels(tmp_path: Path, monkeypatch) -> None:
    """save_state returns before the file is written; the next task (or close) waits for it, so the file is whole."""
    import threading

    import torch

    import medflare.site_runtime as site_runtime
    from medflare.site_runtime import SITE_STATE_FILE

    release, real_save = threading.Event(), torch.save
    monkeypatch.setattr(site_runtime.torch, "save", lambda obj, path: (release.wait(timeout=10), real_save(obj, path)))
    runtime = SiteRuntime(SiteSettings(get_method("fedavg"), TASK, DATA, train={"max_steps": 1}), "site-1", 0, log=lambda m: None,
                          local_dir=tmp_path)
    runtime.train({}, RoundContext(0, 2))  # returns although the write is blocked
    assert not (tmp_path / SITE_STATE_FILE).exists()
    release.set()
    runtime.validate({})  # the next task waits for the write first
    assert (tmp_path / SITE_STATE_FILE).is_file()
    state = torch.load(tmp_path / SITE_STATE_FILE, weights_only=False)
    assert state["optimizer"]["state"]  # Adam's moments after one step


def test_a_jobs_dp_filter_is_checked_against_the_arguments_of_flares_filters() -> None:
    import inspect

    from medflare.flare.privacy import FILTERS

    assert {name: set(inspect.signature(flare_filter).parameters) - {"data_kinds"}
            for name, flare_filter in FILTERS.items()} == {name: set(args) for name, args in DP_FILTER_ARGS.items()}
    check_dp_filter({"filter": "svt", "args": {"epsilon": 0.1}})
    for dp, words in (({"filter": "gauss"}, "filter must be one of"), ({"filtre": "svt"}, "unknown option(s) filtre"),
                      ({"args": {"percentle": 10}}, "args percentle not taken by FLARE's 'percentile' filter")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            check_dp_filter(dp)


def test_a_hu_window_on_8_bit_pngs_is_noted_in_the_site_log(tmp_path: Path) -> None:
    """Issue 61 minors: data.window on PNGs clips grey levels as if they were HU; the site log says so, once."""
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for index in range(10):
            Image.fromarray(np.full((28, 28), 20 * index, dtype=np.uint8)).save(tmp_path / name / f"{index}.png")
    lines: list[str] = []
    data = {"source": f"folder:{tmp_path}", "window": "40,80", "local": True}
    SiteRuntime(SiteSettings(get_method("fedavg"), TaskSpec(2, 1, 28, class_names=["a", "b"]), data), "site-1", 0,
                log=lines.append)
    notes = [line for line in lines if line.startswith("note: data.window=40,80 ")]
    assert len(notes) == 1 and "but 14 of 14 images are PNG/JPEG/TIFF files" in notes[0], lines


def test_a_folder_mixing_colour_and_grey_images_is_noted_in_the_site_log(tmp_path: Path) -> None:
    """Issue 61 minors: the first file decides the channel count; the site log says so when the files mix."""
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for index in range(10):
            shape = (28, 28) if index % 2 else (28, 28, 3)  # 0.png, the first file, is colour
            Image.fromarray(np.zeros(shape, dtype=np.uint8)).save(tmp_path / name / f"{index}.png")
    lines: list[str] = []
    data = {"source": f"folder:{tmp_path}", "local": True}
    SiteRuntime(SiteSettings(get_method("fedavg"), TaskSpec(2, 3, 28, class_names=["a", "b"]), data), "site-1", 0,
                log=lines.append)
    notes = [line for line in lines if line.startswith("note: the images mix colour and grey files")]
    assert len(notes) == 1 and "read as 3-channel, as the first file is (grey ones repeated in 3 channels)" in notes[0]
