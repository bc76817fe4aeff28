"""A real POC run: ``medflare run --env poc`` prints each round as it finishes, ``medflare watch JOB_ID`` (FLARE's
Session API with the lead's kit) follows the same job from another process, and the run folder holds the
server's TensorBoard records with every round's metrics and each site's per-epoch loss."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .._processes import LiveProcess

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

ROUNDS = 3
ROUND_LINE = re.compile(r"round (\d+)/(\d+) done in")


def round_numbers(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := ROUND_LINE.search(line))]


def test_poc_run_and_watch_show_every_round_and_tensorboard_records_them(
    tmp_path: Path, poc_lock, poc_port, monkeypatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MEDFLARE_POC_PORT", str(poc_port))  # a free port: an earlier POC may still hold 8002

    out = tmp_path / "out"
    command = [sys.executable, "-m", "medflare.console.cli", "run", "fedavg", "--env", "poc", "--data", "synthetic:n=300",
               "--rounds", str(ROUNDS), "--max-steps", "3", "--local-epochs", "2", "--out", str(out)]
    with LiveProcess(command) as live:
        live.wait_for("poc: submitted", timeout=300)
        job_id = live.lines[-1].rsplit("job ", 1)[1].strip()
        env = {k: v for k, v in os.environ.items() if k != "NVFLARE_STARTUP_KIT_DIR"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2] / "custom"),
                                                          env.get("PYTHONPATH")]))
        watched = subprocess.run(
            [sys.executable, "-m", "medflare.console.cli", "watch", job_id, "--poc", str(tmp_path / "out.partial" / "poc"),
             "--interval", "1"], capture_output=True, text=True, timeout=900, env=env,
        )
        live.wait_for("results:", timeout=900)
        assert live.proc.wait(timeout=120) == 0, "".join(live.lines[-30:])

    assert watched.returncode == 0, watched.stdout[-3000:] + watched.stderr[-3000:]
    watch_lines = watched.stdout.splitlines()
    assert round_numbers(watch_lines) == list(range(1, ROUNDS + 1)), watched.stdout
    assert any(f"model {ROUNDS} test balanced accuracy" in line for line in watch_lines)
    assert watch_lines[-1] == f"medflare: job {job_id}: FINISHED:COMPLETED"
    assert round_numbers(live.lines) == list(range(1, ROUNDS + 1)), "".join(live.lines)

    results = json.loads((out / "medflare_results.json").read_text())
    senders = sorted(p.name for p in (out / "tb_events").iterdir())
    server = [name for name in senders if not name.startswith("site-")]
    assert len(server) == 1 and {"site-1", "site-2"} <= set(senders), senders
    accumulator = EventAccumulator(str(out / "tb_events" / server[0]))
    accumulator.Reload()
    recorded = [(e.step, e.value) for e in accumulator.Scalars("test/balanced_accuracy")]
    expected = [results["evaluations"][str(v)]["test"]["balanced_accuracy"] for v in range(ROUNDS + 1)]
    assert [step for step, _ in recorded] == list(range(ROUNDS + 1))
    assert [value for _, value in recorded] == pytest.approx(expected, abs=1e-6)
    for site in ("site-1", "site-2"):
        accumulator = EventAccumulator(str(out / "tb_events" / site))
        accumulator.Reload()
        assert len(accumulator.Scalars("train/epoch_loss")) == ROUNDS * 2
        # a POC's sites are on this machine: their local medflare log and FLARE's log of the job are kept
        # (benchmarks/overhead.py --env poc and benchmarks/round_timeline.py read them)
        site_log = (out / "sites" / site / "medflare_site_log.jsonl").read_text()
        spans = [json.loads(line) for line in site_log.splitlines()]
        assert sorted(r["round"] for r in spans if r.get("event") == "task_seconds") == list(range(ROUNDS))
        flare_log = (out / "sites" / site / "flare_job_log.txt").read_text()
        assert flare_log.count("finished processing task") >= ROUNDS
