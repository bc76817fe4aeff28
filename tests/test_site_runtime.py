"""The site side without FLARE: where data comes from, and when evaluation counts are sent."""

import json
from pathlib import Path

import pytest

from medflare.errors import ConfigError, DataError
from medflare.methods.base import RoundContext
from medflare.site_runtime import SiteRuntime, SiteSettings, TaskSpec, read_site_data_config, site_index_from_name

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


def test_site_data_comes_from_the_sites_own_file(tmp_path: Path) -> None:
    (tmp_path / "medflare_site.json").write_text(json.dumps({"data": {"source": "folder:/data/xray"}}))
    config = read_site_data_config(tmp_path, {"source": "site", "image_size": 32})
    assert config == {"image_size": 32, "source": "folder:/data/xray", "local": True, "num_sites": 1}


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
    settings = SiteSettings("fedavg", TASK, DATA, train={"max_steps": 1}, evaluation=mode)
    runtime = SiteRuntime(settings, "site-1", 0, log=lambda m: None)
    _, train_meta = runtime.train({}, RoundContext(0, 1))
    assert (EVAL_KEYS <= set(train_meta)) is in_train and (not EVAL_KEYS & set(train_meta)) is not in_train
    assert (EVAL_KEYS <= set(runtime.validate({}))) is in_validate


def test_unknown_evaluation_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="evaluation"):
        SiteSettings("fedavg", TASK, DATA, evaluation="sometimes")


def test_channel_mismatch_names_the_site() -> None:
    with pytest.raises(DataError, match="site-1.*in_channels=1"):
        SiteRuntime(SiteSettings("fedavg", TaskSpec(5, 1, 28), DATA), "site-1", 0, log=lambda m: None)


def test_job_stage_overrides_merge_into_the_method_stage_defaults() -> None:
    """A job changing one option of one stage keeps the method's other options of that stage."""
    from medflare.registry import get_method
    from medflare.site_runtime import resolve_train_config

    cfg = resolve_train_config(get_method("fed-mae"), {"lr": 1e-3, "stages": {"pretrain": {"warmup_rounds": 3}}})
    pretrain = cfg.for_stage("pretrain")
    assert (pretrain.warmup_rounds, pretrain.betas, pretrain.lr) == (3, (0.9, 0.95), 2e-3)
    assert cfg.lr == 1e-3 and cfg.for_stage("finetune").betas == (0.9, 0.999)


def test_a_train_task_records_where_its_time_went_in_the_site_log(tmp_path: Path) -> None:
    """The spans of a train task (never sent) land in the site's own log; together they are the task's time."""
    import time

    from medflare.site_runtime import SITE_LOG_FILE, TASK_SECONDS_EVENT

    runtime = SiteRuntime(SiteSettings("fedavg", TASK, DATA, train={"max_steps": 2}), "site-1", 0, log=lambda m: None,
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
    runtime = SiteRuntime(SiteSettings("fedavg", TASK, DATA, train={"max_steps": 1}), "site-1", 0, log=lambda m: None,
                          local_dir=tmp_path)
    runtime.train({}, RoundContext(0, 2))  # returns although the write is blocked
    assert not (tmp_path / SITE_STATE_FILE).exists()
    release.set()
    runtime.validate({})  # the next task waits for the write first
    assert (tmp_path / SITE_STATE_FILE).is_file()
    state = torch.load(tmp_path / SITE_STATE_FILE, weights_only=False)
    assert state["optimizer"]["state"]  # Adam's moments after one step
