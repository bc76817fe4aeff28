"""FLARE 2.9 recipes: every method's recipe writes the very job ``medflare export`` writes, refuses what it cannot
honour in one line, and turns the robust defences on for POC and production. Every method's recipe runs in FLARE's
``SimEnv`` in tests/integration/test_every_method_simulator.py (one round per stage, each method's smoke settings)."""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.config
from pathlib import Path

import pytest
from nvflare.recipe import PocEnv, ProdEnv, SimEnv

from medflare import plan as plan_module
from medflare.console.cli import main
from medflare.console.recipes import (
    CONSOLE_FILTER,
    CONSOLE_LOG_FILE,
    MedflareRecipe,
    console_log_config,
    quiet_simulator_console,
    recipe,
)
from medflare.errors import ConfigError
from medflare.registry import list_methods
from medflare.server_setup import DEPLOY_ROBUST, ROBUST_OFF

from .integration._smoke import smoke_run
from .test_job_export import written_robust


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.parametrize("method", list_methods())
def test_a_recipe_exports_exactly_the_job_medflare_export_writes(method: str, tmp_path: Path) -> None:
    run = smoke_run(method)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(dataclasses.asdict(run)))
    assert main(["export", method, "--config", str(config), "-o", str(tmp_path / "cli")]) == 0
    MedflareRecipe(smoke_run(method)).export(str(tmp_path / "recipe"))
    exported, from_recipe = files_of(tmp_path / "cli" / run.job_name), files_of(tmp_path / "recipe" / run.job_name)
    assert sorted(exported) == sorted(from_recipe)
    assert [name for name in exported if exported[name] != from_recipe[name]] == []


def test_a_recipe_reads_the_data_for_its_task_once_and_writes_every_job_from_that_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from medflare.plan import plan_from_job
    from medflare.run_config import RunConfig

    job = recipe("fedavg", rounds=1, data="synthetic:n=200")
    task = job.plan.task

    def read_again(run: RunConfig) -> None:
        raise AssertionError("the task was read from the data again")

    monkeypatch.setattr(plan_module, "task_of", read_again)
    monkeypatch.setattr(plan_module, "_inferred_task", read_again)
    job.export(str(tmp_path / "sim"))
    job.export(str(tmp_path / "poc"), env=PocEnv(num_clients=2))
    assert plan_from_job(tmp_path / "sim" / "fedavg").task == plan_from_job(tmp_path / "poc" / "fedavg").task == task
    assert plan_from_job(tmp_path / "poc" / "fedavg").robust == DEPLOY_ROBUST


def test_recipe_options_are_run_options_checked_in_one_line() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        recipe("fedavg", rounds=1, learning_rate=0.1)
    with pytest.raises(ConfigError, match="rounds must be between 1 and"):
        recipe("fedavg", rounds=0)
    with pytest.raises(ConfigError, match="mode must be one of byoc, preinstalled"):
        recipe("fedavg", mode="docker")


def test_the_environment_must_have_the_recipes_sites(tmp_path: Path) -> None:
    job = recipe("fedavg", rounds=1, clients=2, data="synthetic:n=300")
    with pytest.raises(ConfigError, match="built for 2 sites"):
        job.process_env(SimEnv(num_clients=3, workspace_root=str(tmp_path)))
    with pytest.raises(ConfigError, match="built for 2 sites"):
        job.process_env(SimEnv(clients=["a", "b"], workspace_root=str(tmp_path)))
    job.process_env(SimEnv(num_clients=2, workspace_root=str(tmp_path)))
    preinstalled = recipe("fedavg", rounds=1, clients=2, data="synthetic:n=300", mode="preinstalled")
    with pytest.raises(ConfigError, match="mode='byoc'"):
        preinstalled.process_env(SimEnv(num_clients=2, workspace_root=str(tmp_path)))


def test_flare_add_helpers_are_refused_rather_than_silently_dropped(tmp_path: Path) -> None:
    job = recipe("fedavg", rounds=1, clients=2, data="synthetic:n=300")
    job.add_server_config({"task_request_interval": 1.0})
    with pytest.raises(ConfigError, match="use recipe\\(\\) options instead"):
        job.export(str(tmp_path))


ENVIRONMENTS = {
    "sim": lambda root: SimEnv(num_clients=2, workspace_root=str(root)),
    "poc": lambda root: PocEnv(num_clients=2),
    "prod": lambda root: ProdEnv(startup_kit_location=str(root), username="lead@hospital-a.example.org"),
}


@pytest.mark.parametrize("env, own, expected", [
    ("sim", {}, {}),  # research runs aggregate as the papers do
    ("poc", {}, DEPLOY_ROBUST),  # BYOC with simulated data, yet a deployment
    ("prod", {}, DEPLOY_ROBUST),
    ("prod", {"max_share": 0.4}, {"max_norm_ratio": 10.0, "max_share": 0.4}),  # the recipe's own value wins
    ("prod", {"off": True}, ROBUST_OFF),
])
def test_a_recipe_for_poc_or_production_gets_the_robust_defences(
    env: str, own: dict, expected: dict, tmp_path: Path, monkeypatch
) -> None:
    """FLARE hands the recipe its environment (process_env) before writing the job, in run() as in export()."""
    monkeypatch.setenv("NVFLARE_POC_WORKSPACE", str(tmp_path / "poc"))  # else PocEnv() reads ~/.nvflare
    job = recipe("fedavg", rounds=1, clients=2, data="synthetic:n=300", robust=own)
    job.export(str(tmp_path / "job"), env=ENVIRONMENTS[env](tmp_path))
    robust, record = written_robust(tmp_path / "job" / "fedavg")
    assert robust == expected and record == {"on": bool(any(expected.values())), **ROBUST_OFF, **expected}


def test_an_export_without_an_environment_does_not_keep_the_last_ones(tmp_path: Path) -> None:
    job = recipe("fedavg", rounds=1, clients=2, data="synthetic:n=300")
    job.export(str(tmp_path / "prod"), env=ENVIRONMENTS["prod"](tmp_path))
    job.export(str(tmp_path / "plain"))
    assert written_robust(tmp_path / "prod" / "fedavg")[0] == DEPLOY_ROBUST
    assert written_robust(tmp_path / "plain" / "fedavg")[0] == {}


@pytest.mark.parametrize("mode, data, expected", [
    ("preinstalled", "synthetic:n=300", DEPLOY_ROBUST),
    ("byoc", "site", DEPLOY_ROBUST),
    ("byoc", "synthetic:n=300", {}),  # what SimEnv runs
])
def test_a_recipe_exported_without_an_environment_decides_as_medflare_export(
    mode: str, data: str, expected: dict, tmp_path: Path
) -> None:
    declared = {"task": {"num_classes": 2, "in_channels": 1, "image_size": 28}} if data == "site" else {}
    recipe("fedavg", rounds=1, clients=2, data=data, mode=mode, **declared).export(str(tmp_path))
    assert written_robust(tmp_path / "fedavg")[0] == expected


def console_passes(name: str, level: int) -> bool:
    """Whether the recipe's simulator console shows a record of logger ``name`` at ``level``."""
    spec = dict(console_log_config()["filters"][CONSOLE_FILTER])
    console_filter = logging.config.DictConfigurator({"version": 1}).configure_filter(spec)  # no global change
    return bool(console_filter.filter(logging.LogRecord(name, level, __file__, 1, "message", None, None)))


def test_the_simulator_console_shows_medflare_and_every_warning_but_not_flares_info() -> None:
    config = console_log_config()
    assert config["handlers"]["consoleHandler"]["filters"] == [CONSOLE_FILTER]
    assert console_passes("medflare.flare.controller.MedflareController", logging.INFO)  # round lines
    assert console_passes("medflare.flare.executor.MedflareExecutor", logging.INFO)  # per-site epochs
    for flare_logger in ("nvflare.private.fed.client.client_runner.ClientRunner", "ObjectDownloader"):
        assert not console_passes(flare_logger, logging.INFO)
        assert console_passes(flare_logger, logging.WARNING) and console_passes(flare_logger, logging.ERROR)
    log_file = config["handlers"]["logFileHandler"]  # each participant's log.txt keeps FLARE's whole log
    assert not log_file.get("filters") and config["loggers"]["root"]["level"] == "INFO"


def test_the_console_setting_yields_to_a_flare_log_setting_the_user_chose(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("FL_LOG_LEVEL", raising=False)
    quiet = SimEnv(num_clients=2, workspace_root=str(tmp_path / "ws"))
    quiet_simulator_console(quiet)
    assert quiet.log_config == str(tmp_path / "ws" / CONSOLE_LOG_FILE)
    assert json.loads(Path(quiet.log_config).read_text()) == console_log_config()
    chosen = SimEnv(num_clients=2, workspace_root=str(tmp_path / "ws"), log_config="full")
    quiet_simulator_console(chosen)
    assert chosen.log_config == "full"
    monkeypatch.setenv("FL_LOG_LEVEL", "concise")
    from_environment = SimEnv(num_clients=2, workspace_root=str(tmp_path / "ws"))
    quiet_simulator_console(from_environment)
    assert from_environment.log_config is None  # FLARE's simulator reads FL_LOG_LEVEL itself
