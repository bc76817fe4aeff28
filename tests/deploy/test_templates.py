"""job_templates/: generated from the export builders, every key commented, and `nvflare job create` with each
template yields a job that runs in FLARE's simulator."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from pyhocon import ConfigFactory

from medflare.deploy.templates import TEMPLATES_DIR, stale_templates, template_run
from medflare.flare.job import client_config, server_config
from medflare.registry import list_methods
from medflare.simulate import nvflare_command
from medflare.site_runtime import TaskSpec

REPO = Path(__file__).resolve().parents[2]
TEMPLATE_FILES = ("info.conf", "info.md", "meta.conf", "config_fed_client.conf", "config_fed_server.conf")
# what the test job overrides through template variables (synthetic data has 5 classes, 3 channels)
CLIENT_VARS = ['source="synthetic:n=300"', "partition=iid", "max_steps=1", "batch_size=32", "num_classes=5",
               "in_channels=3"]
SERVER_VARS = ["num_classes=5", "in_channels=3"]
ROUNDS = 3  # every method's default stages fit (fed-mae: 2 pre-training rounds, then fine-tuning)


def test_templates_are_up_to_date() -> None:
    assert stale_templates() == [], "job_templates/ is stale: run 'make templates'"


def test_one_template_per_registered_method() -> None:
    assert sorted(p.name for p in TEMPLATES_DIR.iterdir() if p.is_dir()) == list_methods()
    for method in list_methods():
        for name in TEMPLATE_FILES:
            assert (TEMPLATES_DIR / method / name).is_file(), f"{method}/{name}"


@pytest.mark.parametrize("method", list_methods())
def test_every_key_is_commented(method: str) -> None:
    for name in ("info.conf", "meta.conf", "config_fed_client.conf", "config_fed_server.conf"):
        lines = (TEMPLATES_DIR / method / name).read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*[\w\"-]+\s*=", line):
                assert lines[i - 1].strip().startswith("#"), f"{method}/{name}:{i + 1} has no comment: {line}"


def create_job(method: str, out: Path, rounds: int = ROUNDS) -> Path:
    job = out / method
    command = nvflare_command() + [
        "job", "create", "-j", str(job), "-w", str(TEMPLATES_DIR / method), "-sd", str(REPO / "custom"),
        "-f", "config_fed_client.conf", *CLIENT_VARS,
        "-f", "config_fed_server.conf", *SERVER_VARS, f"num_rounds={rounds}", "-force",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env={"HOME": str(out), "PATH": ""}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return job


def parsed(path: Path) -> dict:
    return json.loads(json.dumps(ConfigFactory.parse_file(str(path)).as_plain_ordered_dict()))


@pytest.mark.slow
@pytest.mark.parametrize("method", list_methods())
def test_job_create_yields_exactly_the_exported_job(method: str, tmp_path: Path) -> None:
    """Each template's created job equals what the export builders write for the same settings, so it runs
    wherever `medflare export` jobs run (tests/integration/test_every_method_simulator.py runs every method)."""
    job = create_job(method, tmp_path)
    assert (job / "app" / "custom" / "medflare" / "flare" / "executor.py").is_file()
    run = template_run(method)
    run.rounds = ROUNDS
    run.data = {"source": "synthetic:n=300", "partition": "iid"}
    run.train = {**run.train, "max_steps": 1, "batch_size": 32}
    task = TaskSpec(num_classes=5, in_channels=3, image_size=28)
    assert parsed(job / "app" / "config" / "config_fed_server.conf") == json.loads(json.dumps(server_config(run, task)))
    assert parsed(job / "app" / "config" / "config_fed_client.conf") == json.loads(json.dumps(client_config(run, task)))
    assert parsed(job / "meta.conf")["scope"] == f"medflare-{method}"


@pytest.mark.slow
def test_created_job_runs_in_the_simulator(tmp_path: Path) -> None:
    job = create_job(list_methods()[0], tmp_path, rounds=1)
    sim = subprocess.run(
        nvflare_command() + ["simulator", str(job), "-w", str(tmp_path / "ws"), "-n", "2", "-t", "2"],
        capture_output=True, text=True, timeout=600,
    )
    results = list((tmp_path / "ws").glob("**/app_server/medflare_results.json"))
    assert results, sim.stdout[-3000:] + sim.stderr[-3000:]
    outcome = json.loads(results[0].read_text())
    assert outcome.get("error") is None and len(outcome["rounds"]) == 1, outcome.get("error")
