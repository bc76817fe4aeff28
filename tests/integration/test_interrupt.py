"""SIGTERM to ``medflare run`` mid-training: every process medflare started stops, and only
``<out>.failed.log`` remains, saying what finished."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from .._processes import LiveProcess, alive, sigterm_and_wait


@pytest.mark.slow
def test_sigterm_stops_the_simulator_and_leaves_a_failed_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "medflare.cli", "run", "fedavg", "--data", "synthetic:n=400", "--rounds", "40",
               "--max-steps", "3", "--out", str(out)]
    with LiveProcess(command) as live:
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
