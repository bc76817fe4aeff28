"""FLARE 2.9 recipes: every method's recipe writes the very job ``medflare export`` writes, refuses what it cannot
honour in one line. Every method's recipe runs in FLARE's ``SimEnv`` in
tests/integration/test_every_method_simulator.py (one round per stage, each method's smoke settings)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from nvflare.recipe import SimEnv

from medflare.cli import main
from medflare.errors import ConfigError
from medflare.recipes import MedflareRecipe, recipe
from medflare.registry import list_methods

from .integration.test_every_method_simulator import smoke_run


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


def test_recipe_options_are_run_options_checked_in_one_line() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        recipe("fedavg", rounds=1, learning_rate=0.1)
    with pytest.raises(ConfigError, match="rounds must be >= 1"):
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
