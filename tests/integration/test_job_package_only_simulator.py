"""Issue 64, end to end in FLARE's simulator: a BYOC job runs at sites that have medflare's job package only. Every
process of the simulator starts with tests/integration/job_only/sitecustomize.py: medflare on sys.path outside the
test's folder is taken off (so each process imports the medflare the job brought), and ``import medflare.console``
raises ImportError. The job completes its rounds, and no process even tried to import the console."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from medflare.console.job_export import write_job
from medflare.plan import APP_NAME, resolve
from medflare.run_config import RunConfig

from ._simulated import simulate

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

RUN = RunConfig(method="fedavg", rounds=2, clients=2, data={"source": "synthetic:n=300"},
                train={"max_steps": 2, "batch_size": 32})
JOB_ONLY = Path(__file__).resolve().parent / "job_only"


def job_only_env(root: Path, log: Path) -> dict[str, str]:
    """This environment, with the job-package-only start-up first and the checkout's custom/ off PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": str(JOB_ONLY), "MEDFLARE_JOB_ONLY_ROOT": str(root),
            "MEDFLARE_JOB_ONLY_LOG": str(log)}


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_start_up_hides_the_checkout_and_refuses_the_console(tmp_path: Path) -> None:
    """The check below can fail: a process with this start-up finds no medflare outside ``root``, and with a job's
    package on its path it imports medflare but not medflare.console."""
    log = tmp_path / "events.jsonl"
    job = write_job(resolve(RUN, "byoc"), tmp_path / "jobs", "byoc")
    env = {**job_only_env(tmp_path, log), "PYTHONPATH": f"{JOB_ONLY}{os.pathsep}{job / APP_NAME / 'custom'}"}
    probe = "import medflare.flare.executor, medflare.deploy.filters\ntry:\n    import medflare.console\n" \
            "except ImportError:\n    print('refused')\n"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["refused"], done.stderr
    found = [event["medflare"] for event in events(log) if "medflare" in event]
    assert found == [str(job / APP_NAME / "custom" / "medflare" / "__init__.py")]
    assert any(event.get("refused") == "medflare.console" for event in events(log))


def test_a_byoc_job_completes_where_its_processes_have_the_job_package_only(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    job = write_job(resolve(RUN, "byoc"), tmp_path / "jobs", "byoc")
    assert not (job / APP_NAME / "custom" / "medflare" / "console").exists()
    assert [path for path in job.rglob("*") if "console" in path.name] == []
    results, logs = simulate(job, tmp_path / "ws", env=job_only_env(tmp_path, log))
    assert "error" not in results and len(results["rounds"]) == RUN.rounds, logs[-3000:]
    workers = {event["pid"] for event in events(log) if "--client" in event.get("argv", [])}
    assert len(workers) >= 2  # each site's worker process started with the job-only start-up
    found = {event["pid"]: event["medflare"] for event in events(log) if "medflare" in event}
    assert workers <= set(found)  # ... and imported medflare, from the job's folder in the simulator's workspace
    assert all(origin and Path(origin).is_relative_to(tmp_path / "ws") for origin in found.values()), found
    assert any("app_server" in Path(origin).parts for origin in found.values())  # the server's process too
    assert [event for event in events(log) if "refused" in event] == []  # no process tried the console
