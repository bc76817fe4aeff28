"""A recipe run in FLARE's SimEnv shows medflare's lines on the console, not FLARE's INFO log, which stays in the
simulator's log files (issue 30, item 11)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from nvflare.recipe import SimEnv

from medflare.recipes import recipe

# INFO lines FLARE's simulator prints several times a round per site with its default ("concise") console
FLARE_INFO = re.compile(r"set transaction info|object has been downloaded|Finished one task run")


@pytest.mark.slow
def test_a_recipe_run_prints_medflare_progress_and_keeps_flares_info_log_in_files(
    tmp_path: Path, capfd, monkeypatch
) -> None:
    monkeypatch.delenv("FL_LOG_LEVEL", raising=False)
    job = recipe("fedavg", rounds=1, clients=2, data="synthetic:n=200", train={"max_steps": 1})
    job.execute(SimEnv(num_clients=2, workspace_root=str(tmp_path / "ws")))
    console = capfd.readouterr()
    shown = (console.out + console.err).splitlines()
    assert any("medflare: round 1/1" in line for line in shown)
    assert any("site-1: round 1/1 epoch 1/1" in line for line in shown)
    assert [line for line in shown if FLARE_INFO.search(line)] == []
    server_log = (tmp_path / "ws" / "fedavg" / "server" / "log.txt").read_text()
    assert FLARE_INFO.search(server_log)  # not lost: in the log file, where FLARE's INFO log belongs
