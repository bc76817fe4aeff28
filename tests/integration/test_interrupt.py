"""SIGTERM to ``medflare run`` mid-training: every process medflare started stops, and only
``<out>.failed.log`` remains, saying what finished. SIGKILL, which medflare cannot handle: nothing it started
survives it either (the simulator and its workers, in sessions of their own, die with medflare)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from .._processes import LiveProcess, alive, kill_all, left_after, processes_naming, sigterm_and_wait


def medflare_run(out: Path, rounds: int) -> list[str]:
    """A small synthetic ``medflare run`` in the simulator (``rounds`` long enough to be interrupted)."""
    return [sys.executable, "-m", "medflare.console.cli", "run", "fedavg", "--data", "synthetic:n=400", "--rounds",
            str(rounds), "--max-steps", "3", "--out", str(out)]


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_sigterm_stops_the_simulator_and_leaves_a_failed_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with LiveProcess(medflare_run(out, rounds=40)) as live:
        live.wait_for("round 2/40", timeout=240)  # the sites are training
        children = live.descendants()
        assert any("simulator" in " ".join(p.cmdline()) for p in children), [p.cmdline() for p in children]

        code = sigterm_and_wait(live, timeout=90)

    assert code == 128 + signal.SIGTERM
    time.sleep(1)  # medflare waits for its children before it exits: nothing may outlive it (beyond a reap)
    assert alive(children) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.failed.log"]
    log = (tmp_path / "out.failed.log").read_text()
    finished = int(log.rsplit("rounds finished: ", 1)[1].split("/")[0])
    assert "interrupted by SIGTERM" in log and 1 <= finished < 40


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_sigkill_leaves_no_process_of_the_run(tmp_path: Path) -> None:
    staging = tmp_path / "out.partial"  # every process of the run names it: job folder, workspace
    try:
        with LiveProcess(medflare_run(tmp_path / "out", rounds=30)) as live:
            live.wait_for("round 2/30", timeout=240)  # the simulator's workers are training
            assert len(processes_naming(staging)) >= 3, "the simulator, its job runner and workers should run"
            live.proc.kill()
            assert live.proc.wait(timeout=10) == -signal.SIGKILL
            assert left_after(staging, seconds=8) == []
    finally:
        kill_all(processes_naming(staging))
