"""Faults in a real FLARE POC (3 sites over mTLS, one POC for the module), with the deployment defaults.

- A site that dies mid-job (every process of it SIGKILLed) costs its updates, not the job: training completes
  with the other two sites (``min_clients`` 2 of 3), the persisted global model is intact, and FLARE ends the job
  within a bound. FLARE reports COMPLETED when it noticed the dead site (no heartbeat for
  ``SITE_HEARTBEAT_TIMEOUT`` s) while the job ran, else FINISHED:ABNORMAL for the site's missing end-of-job report.
- A server that dies mid-job (SIGKILL) and is restarted does not resume the job by itself (FLARE 2.9 cannot:
  ``ServerEngine.persist_components`` is a no-op and nothing calls ``JobRunner.restore_running_job``). The same
  job submitted again with ``resume_from`` continues from the last round the controller checkpointed: every
  round once, the earlier rounds' records kept, the model intact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from medflare.console.deploy.apps import deployment_run
from medflare.console.deploy.poc import PocSession, find_results, retarget_job
from medflare.console.deploy.policies import SITE_HEARTBEAT_TIMEOUT
from medflare.console.job_export import set_resume
from medflare.flare.controller import CHECKPOINT_FILE
from medflare.ops.checkpoint import load_checkpoint
from medflare.plan import build_global_model, task_of
from medflare.run_config import RunConfig

from .._plans import write_run_job

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

METHOD = "fedavg"
QUICK = {"max_steps": 3, "batch_size": 32}
SHARED_DATA = {"source": "synthetic:n=400", "partition": "iid"}
STRAGGLER_SECONDS = 5  # deployment default is 600: how long a round waits for a missing site once 2 answered
# Seconds FLARE may take after the kill to end the job: its remaining rounds, then at most the heartbeat timeout.
OUTAGE_BOUND = 90 + SITE_HEARTBEAT_TIMEOUT
JOB_TIMEOUT = 240


def fault_run(name: str, rounds: int) -> RunConfig:
    """The deployment defaults (3 sites, min_clients 2, task timeout) on shared synthetic data, quick rounds."""
    return deployment_run(METHOD, rounds=rounds, data=dict(SHARED_DATA), task={}, train=dict(QUICK),
                          straggler_seconds=STRAGGLER_SECONDS, name=name)


@pytest.fixture(scope="module")
def faults(tmp_path_factory, poc_lock, poc_port):
    """A 3-site POC whose processes start cold: the tests kill a participant's processes by their command lines."""
    root = tmp_path_factory.mktemp("poc-faults")
    # tied: the POC dies with this test process, also when a cancelled run (CI, Ctrl-C) skips the teardown
    session = PocSession(root / "poc", port=poc_port, echo=lambda line: None, tied=True)
    try:
        session.prepare(3, allow_job_data=True)
        session.start()
        yield {"session": session, "root": root}
    finally:
        session.stop()
        session.clean()


def test_a_dead_site_costs_its_updates_not_the_job(faults) -> None:
    session: PocSession = faults["session"]
    run = fault_run("site-outage", rounds=3)
    job_id = session.submit(write_run_job(run, faults["root"] / "jobs" / "outage", mode="preinstalled"))
    _wait_for_checkpoint(session, job_id, next_round=1)
    killed = _kill(session, "site-2")  # the whole site: its FLARE daemon, client and job processes
    killed_at = time.time()
    status = session.wait(job_id, timeout=OUTAGE_BOUND)
    elapsed = time.time() - killed_at
    assert killed and elapsed < OUTAGE_BOUND
    dead_site_report = f"Failing job {job_id}: terminal outcome unavailable from site-2: client dead"
    assert status == "FINISHED:COMPLETED" or (
        status == "FINISHED:ABNORMAL" and dead_site_report in session.server_log()
    ), (status, session.server_log()[-3000:])
    download = session.download(job_id, faults["root"] / "downloads")
    results = json.loads(find_results(download).read_text())
    assert [r["round"] for r in results["rounds"]] == [0, 1, 2] and "error" not in results
    assert set(results["rounds"][-1]["share"]) == {"site-1", "site-3"}  # site-2's round 3 never came
    assert results["evaluations"][str(run.rounds)]["sites"] == ["site-1", "site-3"]
    _assert_model_intact(find_results(download).parent / "FL_global_model.pt", run)


def test_a_restarted_server_resumes_the_job_from_its_last_round(faults) -> None:
    session: PocSession = faults["session"]
    server = session.state["server"]
    run = fault_run("server-crash", rounds=3)
    first_dir = write_run_job(run, faults["root"] / "jobs" / "crash", mode="preinstalled")
    retarget_job(first_dir, ["site-1", "site-3"], "server-crash")  # site-2 may be down after the outage test
    first = session.submit(first_dir)
    checkpoint = _wait_for_checkpoint(session, first, next_round=1)
    assert _kill(session, server)
    _clear_stale_pid_files(session.kit(server))
    # 300 s: on 2 loaded cores (4 test workers) this once took over 120 s (CI of dea96f9), 20-40 s when idle
    session.nvflare("poc", "start", "-p", server, "--timeout", "60", timeout=300, starts=True)
    _wait_until_connected(session, ["site-1", "site-3"])

    resumed_dir = set_resume(shutil.copytree(first_dir, faults["root"] / "jobs" / "resumed"), first)
    resumed = session.submit(resumed_dir)
    status = session.wait(resumed, timeout=JOB_TIMEOUT)
    assert status == "FINISHED:COMPLETED", session.server_log()[-3000:]
    download = session.download(resumed, faults["root"] / "downloads")
    results = json.loads(find_results(download).read_text())
    crashed = load_checkpoint(checkpoint)[1]  # the crashed job's last checkpoint: FLARE never resumed it
    done_before = crashed["next_round"]
    assert results["resumed"][-1]["from_job"] == first and results["resumed"][-1]["start_round"] == done_before
    assert 1 <= done_before < run.rounds  # killed mid-job: the resumed job ran the remaining rounds
    assert [r["round"] for r in results["rounds"]] == [0, 1, 2]
    assert results["rounds"][:done_before] == crashed["results"]["rounds"]  # kept, not re-run
    assert str(run.rounds) in results["evaluations"] and "error" not in results
    _assert_model_intact(find_results(download).parent / "FL_global_model.pt", run)


def _server_app(session: PocSession, job_id: str) -> Path:
    return session.kit(session.state["server"]) / job_id / "app_server"


def _wait_for_checkpoint(session: PocSession, job_id: str, next_round: int, timeout: float = 180) -> Path:
    """Wait until the running job's controller checkpointed ``next_round`` rounds; return the checkpoint."""
    path = _server_app(session, job_id) / CHECKPOINT_FILE
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if load_checkpoint(path)[1]["next_round"] >= next_round:
                return path
        except (OSError, ValueError, KeyError):
            pass  # not written yet
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not checkpoint round {next_round} within {timeout} s")


def _kill(session: PocSession, participant: str) -> list[int]:
    """SIGKILL every process of one POC participant (its command line names the participant's kit)."""
    kit = str(session.kit(participant))
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(arg == kit or arg.startswith(kit + "/") for arg in args):
            pids.append(int(entry.name))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 30  # gone from the process table, else FLARE's start.sh sees "one instance running"
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    return pids


def _clear_stale_pid_files(kit: Path) -> None:
    """What an admin does after a crash when FLARE's start.sh reports "one instance running": remove the pid files
    of processes that no longer live (a SIGKILLed daemon can linger as a zombie until its parent reaps it)."""
    for name in ("daemon_pid.fl", "pid.fl"):
        path = Path(kit) / name
        if path.is_file() and not _alive(int(path.read_text().split()[0])):
            path.unlink()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is still a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_until_connected(session: PocSession, sites: list[str], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if set(sites) <= set(session.connected_sites()):
            return
        time.sleep(2)
    raise AssertionError(f"{sites} did not reconnect to the restarted server within {timeout} s")


def _assert_model_intact(path: Path, run: RunConfig) -> None:
    """The persisted global model loads, has exactly the method's keys and only finite values."""
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    task = task_of(run)
    expected = build_global_model(METHOD, run.model, task.num_classes, task.in_channels, task.image_size)
    assert set(state) == set(expected.state_dict())
    assert all(np.isfinite(np.asarray(value, dtype=np.float64)).all() for value in state.values())
