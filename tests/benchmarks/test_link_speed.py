"""The link-speed benchmark's floor, its reading of the server's and the sites' records, and its table, on hand-made
records (its runs need root and take minutes per speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import load_benchmark

link = load_benchmark("link_speed")
SITE_LOG = "medflare_site_log.jsonl"


def results(walls: list[float], down: int = 1_000_000, up: tuple[int, int] = (900_000, 1_000_000)) -> dict:
    """A results file of len(walls) rounds that follow each other, 1 s of server work after each."""
    rounds, started = [], 100.0
    for index, wall in enumerate(walls):
        rounds.append({"round": index, "started_at": started, "wall_seconds": wall, "task_bytes": {"train": down},
                       "payload": {"hospital-a": {"bytes": up[0]}, "hospital-b": {"bytes": up[1]}}})
        started += wall + 1.0
    return {"rounds": rounds}


SPANS = {"hospital-a": {r: {"evaluate": 1.0, "train": 2.0} for r in range(3)},
         "hospital-b": {r: {"evaluate": 1.5, "train": 2.5, "encode": 0.5} for r in range(3)}}


def test_the_floor_is_both_transfers_at_the_link_rate_plus_the_slowest_sites_work() -> None:
    assert link.floor_seconds(12_500_000, 12_500_000, 100, 2.0) == pytest.approx(4.0)  # 2e8 bits at 1e8 bit/s
    assert link.floor_seconds(12_500_000, 12_500_000, 20, 0.0) == pytest.approx(10.0)
    assert link.floor_seconds(44_700_000, 44_700_000, 1000, 3.0) == pytest.approx(3.7152)
    with pytest.raises(ValueError, match="> 0 Mbit/s"):
        link.floor_seconds(1, 1, 0, 1.0)


def test_rounds_are_timed_start_to_start_with_the_largest_result_and_the_slowest_site() -> None:
    rows = link.round_rows(results([10.0, 6.0, 5.0]), SPANS)
    assert [r["wall"] for r in rows] == [11.0, 7.0, 5.0]  # the server's work after a round counts; the last: its wall
    assert all(r["bytes_down"] == 1_000_000 and r["bytes_up"] == 1_000_000 for r in rows)
    assert all(r["work"] == pytest.approx(4.5) for r in rows)  # hospital-b: 1.5 + 2.5 + 0.5
    assert [r["round"] for r in rows] == [1, 2, 3]


def test_a_round_without_download_bytes_or_site_timing_is_refused() -> None:
    old_server = results([5.0, 5.0])
    del old_server["rounds"][1]["task_bytes"]
    with pytest.raises(ValueError, match="round 2 has no download bytes"):
        link.round_rows(old_server, SPANS)
    with pytest.raises(ValueError, match="round 1 has no"):
        link.round_rows(results([5.0]), {})


def test_the_table_line_leaves_round_one_out_and_divides_by_the_floor() -> None:
    rows = link.round_rows(results([30.0, 7.0, 5.0], down=6_250_000, up=(6_250_000, 6_250_000)), SPANS)
    row = link.speed_row(100, rows)
    assert row["rounds_measured"] == [2, 3]
    assert row["s_per_round"] == pytest.approx(6.5)  # (8 + 5) / 2; round 1's 31 s of start-up is not in it
    assert row["transfer_floor"] == pytest.approx(1.0) and row["floor"] == pytest.approx(5.5)
    assert row["ratio"] == pytest.approx(6.5 / 5.5)


def test_site_timings_come_from_each_sites_own_logs_of_every_job(tmp_path: Path) -> None:
    def write(name: str, records: list[dict]) -> None:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")

    write(f"hospital-a.job1.{SITE_LOG}", [{"event": "task_seconds", "round": 0, "seconds": {"train": 2.0}},
                                          {"event": "fed_mas_w", "round": 0, "w": 0.5}])
    write(f"hospital-a.job2.{SITE_LOG}", [{"event": "task_seconds", "round": 1, "seconds": {"train": 3.0}}])
    write(f"hospital-b.job1.{SITE_LOG}", [{"event": "task_seconds", "round": 0, "seconds": {"train": 4.0}}])
    (tmp_path / "hospital-b.log").write_text("FLARE's own log is not read\n")
    assert link.site_spans(tmp_path) == {"hospital-a": {0: {"train": 2.0}, 1: {"train": 3.0}},
                                         "hospital-b": {0: {"train": 4.0}}}


def test_the_report_says_whether_the_goal_at_100_mbit_is_met() -> None:
    row = {"mbit": 100.0, "s_per_round": 9.0, "floor": 8.0, "ratio": 1.125, "transfer_floor": 7.2, "work": 0.8,
           "bytes_down": 44_700_000, "bytes_up": 44_700_100, "rounds_measured": [2, 3]}
    table = link.markdown([row], {"rounds": 3})
    assert "| 100 | 9.00 | 8.00 | 1.125 | 7.20 | 0.80 | 44,700,000 / 44,700,100 | 2, 3 |" in table
    assert "(met: 1.125)" in table
    assert "(missed: 1.200)" in link.markdown([{**row, "ratio": 1.2}], {})
    assert "Goal" not in link.markdown([{**row, "mbit": 20.0}], {})


def test_each_speed_shapes_every_hospital_and_the_dtype_applies_both_ways() -> None:
    args = link.parse_args(["--speeds", "100", "--rounds", "2", "--dtype", "float16"])
    plan = link.rehearsal(args, 100.0)
    assert plan.rates == {"hospital-a": 100.0, "hospital-b": 100.0} and plan.model == "resnet18"
    assert (plan.transfer_dtype, plan.download_dtype, plan.rounds) == ("float16", "float16", 2)
    with pytest.raises(SystemExit):
        link.parse_args(["--rounds", "1"])  # round 1 is never measured


def test_a_round_splits_into_download_site_upload_and_server_for_the_last_site_to_answer() -> None:
    record = {"round": 1, "started_at": 100.0, "wall_seconds": 10.0,
              "sites": {"hospital-a": {"result_at": 8.0}, "hospital-b": {"result_at": 9.5}}}
    walls = {"hospital-a": {1: {"began": 103.0, "ended": 105.0}}, "hospital-b": {1: {"began": 104.0, "ended": 106.5}}}
    phases = link.round_phases(record, walls)
    assert phases == pytest.approx({"download": 4.0, "site": 2.5, "upload": 3.0, "server": 0.5})  # hospital-b's
    assert sum(phases.values()) == pytest.approx(record["wall_seconds"])
    assert link.round_phases(record, {"hospital-a": walls["hospital-a"]}) is None  # no wall times of the last site


def test_the_table_shows_each_phase_against_its_floor_when_the_sites_logged_wall_times(tmp_path: Path) -> None:
    log = tmp_path / f"hospital-a.job.{SITE_LOG}"
    log.write_text(json.dumps({"event": "task_seconds", "round": 0, "seconds": {"train": 1.0},
                               "wall": {"began": 1.0, "ended": 2.0}}) + "\n" + json.dumps({"event": "other"}) + "\n")
    assert link.site_walls(tmp_path) == {"hospital-a": {0: {"began": 1.0, "ended": 2.0}}}
    runs = results([30.0, 7.0, 5.0], down=6_250_000, up=(6_250_000, 6_250_000))
    for record in runs["rounds"]:
        record["sites"] = {"hospital-a": {"result_at": record["wall_seconds"] - 0.5}}
    walls = {"hospital-a": {r["round"]: {"began": r["started_at"] + 1.0, "ended": r["started_at"] + 2.0}
                            for r in runs["rounds"]}}
    row = link.speed_row(100, link.round_rows(runs, SPANS, walls))
    assert row["phase_floors"]["download"] == pytest.approx(0.5)  # 5e7 bits at 1e8 bit/s
    assert row["phases"]["server"] == pytest.approx(0.5)
    assert "| 100 | 1.00 / 0.50 | 1.00 / 4.50 |" in link.markdown([row], {})  # site floor: the slowest spans
