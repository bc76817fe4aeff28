"""benchmarks/round_timeline.py: a round's steps from FLARE's log lines, checked on a hand-made workspace."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import load_benchmark

timeline = load_benchmark("round_timeline")
DAY = "2026-11-25 06:00:"
SERVER = """\
{d}00,000 - MedflareController - INFO - [identity=simulator_server] - medflare: round 2/3 (train) started
{d}00,100 - ServerRunner - INFO - [peer=site-1] - assigned task to client site-1: name=train, id=a
{d}00,400 - ServerRunner - INFO - [peer=site-2] - assigned task to client site-2: name=train, id=b
{d}02,000 - ServerRunner - INFO - [peer=site-1] - got result from client site-1 for task: name=train, id=a
{d}02,900 - ServerRunner - INFO - [peer=site-2] - got result from client site-2 for task: name=train, id=b
{d}03,000 - MedflareController - INFO - [identity=simulator_server] - medflare: round 2/3 done in 3.0s
"""
SITE = """\
{d}{down} - function - INFO - [client] download ref=x done: elapsed=0.2s size=42.7MB
{d}{done} - ClientRunner - INFO - [identity=site] - finished processing task
"""


def workspace(root: Path) -> Path:
    (root / "server").mkdir(parents=True)
    (root / "server" / "log.txt").write_text(SERVER.format(d=DAY))
    for site, down, done in (("site-1", "00,300", "01,500"), ("site-2", "00,650", "02,450")):
        (root / site).mkdir()
        (root / site / "log.txt").write_text(SITE.format(d=DAY, down=down, done=done))
    return root


def test_the_steps_are_those_of_the_site_whose_result_came_last(tmp_path: Path) -> None:
    steps = timeline.round_steps(workspace(tmp_path))
    assert list(steps) == [2]
    expected = {"pickup": 0.4, "download": 0.25, "work": 1.8, "upload": 0.45, "server after last result": 0.1,
                "round wall": 3.0}  # the last round: start to done (no next start)
    assert steps[2] == pytest.approx(expected, abs=1e-6)  # site-2, not site-1 (pickup 0.1, upload 0.5)


def test_a_workspace_without_rounds_says_what_is_missing(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "log.txt").write_text("no rounds here\n")
    monkeypatch.setattr("sys.argv", ["round_timeline.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="no complete round"):
        timeline.main()


def test_a_poc_run_folder_reads_the_kept_flare_logs(tmp_path: Path) -> None:
    """`medflare run --env poc` keeps poc_server.log and sites/<site>/flare_job_log.txt: the same steps."""
    simulated = workspace(tmp_path / "sim")
    poc = tmp_path / "poc"
    (poc / "sites").mkdir(parents=True)
    (poc / "poc_server.log").write_text((simulated / "server" / "log.txt").read_text())
    for site in ("site-1", "site-2"):
        (poc / "sites" / site).mkdir()
        (poc / "sites" / site / "flare_job_log.txt").write_text((simulated / site / "log.txt").read_text())
    assert timeline.round_steps(poc) == timeline.round_steps(simulated)
    assert timeline.round_steps(poc)[2]["pickup"] == pytest.approx(0.4, abs=1e-6)
