"""The FLARE job folder every environment gets: defaults that keep a dead site from hanging a job, and resuming."""

import json
from pathlib import Path

from medflare.deploy.apps import deployment_run
from medflare.job_export import DEFAULT_TASK_TIMEOUT, export_job, server_config, set_resume
from medflare.run_config import RunConfig
from medflare.site_runtime import TaskSpec

TASK = TaskSpec(num_classes=2, in_channels=1, image_size=28)


def controller_args(run: RunConfig) -> dict:
    return server_config(run, TASK)["workflows"][0]["args"]


def aggregator_args(run: RunConfig) -> dict:
    (aggregator,) = [c for c in server_config(run, TASK)["components"] if c["id"] == "aggregator"]
    return aggregator["args"]


def test_stream_aggregation_is_off_unless_the_run_turns_it_on() -> None:
    assert aggregator_args(RunConfig())["stream_aggregation"] is False
    assert aggregator_args(RunConfig(stream_aggregation=True))["stream_aggregation"] is True


def test_every_task_has_a_timeout_unless_the_run_sets_one() -> None:
    assert DEFAULT_TASK_TIMEOUT > 0
    assert controller_args(RunConfig())["train_timeout"] == DEFAULT_TASK_TIMEOUT
    assert controller_args(RunConfig(task_timeout=120))["train_timeout"] == 120


def test_deployment_jobs_go_on_without_one_site() -> None:
    run = deployment_run("fedavg")
    assert 2 <= controller_args(run)["min_clients"] < run.clients  # never one hospital's update alone


def test_set_resume_names_the_crashed_job_in_the_controller(tmp_path: Path) -> None:
    job = export_job(RunConfig(data={"source": "site"}, task=dict(vars(TASK))), tmp_path, TASK, mode="preinstalled")
    set_resume(job, "0b6e1c4e-4a0e-4d43-9a53-7f0f3c7c1e11")
    config = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    assert config["workflows"][0]["args"]["resume_from"] == "0b6e1c4e-4a0e-4d43-9a53-7f0f3c7c1e11"
