"""The peer benchmark's own parts (the benchmark itself needs Flower's venv and runs for many minutes): its command
line, the figures and goals from hand-made rounds, and that every side reads the same workload."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from .conftest import load_benchmark

peer = load_benchmark("peer_flower")
fedavg_site = load_benchmark("fedavg_site")

NO_FLOWER = ["--flower-venv", "/nonexistent-flower-venv"]


def test_quick_mode_and_the_defaults_compare_every_side_on_both_models() -> None:
    default = peer.parse_args(NO_FLOWER + ["--sides", "bare"])
    assert default.models == ["resnet18", "cnn"] and default.rounds >= 2
    quick = peer.parse_args(NO_FLOWER + ["--quick", "--sides", "bare", "medflare-sim"])
    assert (quick.models, quick.clients, quick.rounds, quick.steps) == (["cnn"], [2], 3, 5)


def test_a_flower_side_without_flower_s_venv_and_a_single_round_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        peer.parse_args(NO_FLOWER + ["--sides", "flower-sim"])
    assert "make bench-peer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peer.parse_args(NO_FLOWER + ["--sides", "bare", "--rounds", "1"])


def test_a_side_run_as_this_script_gets_the_same_cell() -> None:
    args = peer.parse_args(NO_FLOWER + ["--sides", "bare", "--rounds", "4", "--steps", "7", "--seed", "3"])
    command = peer.side_command("medflare-poc", args, "cnn", 4, Path("/tmp/r.json"))
    side = peer.parse_args(command[2:])
    assert (side.side, side.models, side.clients, side.rounds, side.steps, side.seed, side.data) == (
        "medflare-poc", ["cnn"], [4], 4, 7, 3, args.data)
    simulation = peer.side_command("flower-sim", args, "cnn", 4, Path("/tmp/r.json"))
    assert simulation[0] == "/nonexistent-flower-venv/bin/python" and simulation[1:] == ["-m", "flower_peer.simulate"]


def test_flower_round_walls_run_start_to_start_and_the_last_to_its_aggregation() -> None:
    rounds = [{"started_at": 10.0, "aggregated_at": 14.0}, {"started_at": 15.0, "aggregated_at": 19.5},
              {"started_at": 20.5, "aggregated_at": 24.0}]
    assert peer.flower_walls(rounds) == pytest.approx([5.0, 5.5, 3.5])


def flower_site(start: float, work: float = 3.0, entered: float = 0.5, left: float = 3.7) -> dict:
    """A client's reply: its timings and, on its own clock, when it loaded, entered and left its handler."""
    return {"work": work, "train": 2.0, "images": 320, "loaded_at": start, "entered_at": start + entered,
            "left_at": start + left}


def flower_raw() -> dict:
    return {"rounds": [
        {"started_at": 0.0, "aggregated_at": 9.0, "sites": [flower_site(0.0), flower_site(0.0, work=4.0, left=8.0)],
         "bytes_up": [100, 120], "bytes_down": [110, 110], "errors": []},
        {"started_at": 10.0, "aggregated_at": 14.0, "sites": [flower_site(10.0), flower_site(10.0, left=3.5)],
         "bytes_up": [100, 100], "bytes_down": [110, 110], "errors": []},
        {"started_at": 15.0, "aggregated_at": 20.0, "sites": [flower_site(15.0, entered=1.5, left=4.8),
                                                               flower_site(15.0)],
         "bytes_up": [100, 100], "bytes_down": [110, 110], "errors": []},
    ]}


def test_each_side_s_record_becomes_walls_work_and_bytes() -> None:
    flower = peer.normalise("flower-sim", flower_raw(), 999)
    assert flower["walls"] == [10.0, 5.0, 5.0] and flower["work"][0] == [3.0, 4.0]
    assert (flower["bytes_up"], flower["bytes_down"]) == (120, 110)
    # rounds 2 and 3, the site that left last: dispatch 0.5 and 1.5 s, set-up 3.7 - 0.5 - 3 and 4.8 - 1.5 - 3,
    # return 14 - 13.7 and 20 - 19.8
    assert flower["parts"] == pytest.approx({"dispatch": 1.0, "set_up": 0.25, "work": 3.0, "return": 0.25})
    bare = peer.normalise("bare", {"rounds": [{"wall": 2.0, "sites": [{"work": 1.5}]}]}, 999)
    assert bare == {"walls": [2.0], "work": [[1.5]], "bytes_up": 999, "bytes_down": 999}
    medflare = peer.normalise("medflare-sim", {"rounds": [{"wall": 3.0, "work": {"site-1": 2.5, "site-2": 2.0}}],
                                               "payload": {"site-1": {"bytes_per_round": [50, 51]}}}, 999)
    assert medflare == {"walls": [3.0], "work": [[2.5, 2.0]], "bytes_up": 51, "bytes_down": None}
    broken = flower_raw()
    broken["rounds"][1]["errors"] = ["ClientApp raised"]
    with pytest.raises(RuntimeError, match="1 client error"):
        peer.normalise("flower-deploy", broken, 999)


def measured(round_seconds: float) -> dict:
    walls = [round_seconds * 3, round_seconds, round_seconds]
    rounds = {"walls": walls, "work": [[w - 1.0] for w in walls], "bytes_up": 4_000_000, "bytes_down": None}
    return peer.side_figures(rounds, {"total_seconds": 60.0, "cpu_seconds": 100.0, "peak_rss_bytes": 2**31,
                                      "device": "cpu"})


def test_goals_say_met_or_missed_and_by_how_much() -> None:
    result = peer.compare({"bare": measured(8.0), "medflare-sim": measured(9.0), "flower-sim": measured(10.0),
                           "medflare-poc": measured(12.0), "flower-deploy": measured(10.0)})
    sides, goals = result["sides"], result["goals"]
    assert sides["medflare-sim"]["round_seconds"] == 9.0 and sides["medflare-sim"]["coordination_seconds"] == 1.0
    assert sides["flower-sim"]["ratio_to_bare"] == pytest.approx(1.25)
    assert goals["simulation"]["met"] and goals["simulation"]["gap_seconds"] == pytest.approx(-1.0)
    assert not goals["deployment"]["met"] and goals["deployment"]["gap_percent"] == pytest.approx(20.0)
    table = peer.markdown({"models": ["cnn"]}, {"cnn, 2 sites": result})
    assert "**met**, 1.00 s/round (10.0 %) below Flower" in table
    assert "**missed**, 2.00 s/round (20.0 %) above Flower" in table
    assert "| medflare-sim | cpu | 9.00 | 1.125 | 1.00 | 27.00 | 60.0 | 100 | 2.00 | 4.0 | - |" in table


def test_a_pair_with_a_side_left_out_has_no_goal() -> None:
    assert peer.compare({"bare": measured(8.0), "medflare-sim": measured(9.0)})["goals"] == {}


def test_peak_memory_is_the_largest_summed_pass_over_the_tree() -> None:
    traces = {1: SimpleNamespace(samples=[(1.0, 100, 100), (2.0, 300, 300)]),
              2: SimpleNamespace(samples=[(1.0, 250, 250), (2.0, 10, 250)])}
    assert peer.peak_tree_rss(traces) == 350
    assert peer.peak_tree_rss({}) is None


def test_flower_s_clients_rebuild_from_the_workload_file_the_partitions_medflare_builds(tmp_path: Path) -> None:
    overhead = load_benchmark("overhead")
    args = overhead.parse_args(["--model", "cnn", "--data", "synthetic:n=120", "--rounds", "2", "--steps", "1"])
    run = overhead.build_run(args, 2)
    load = json.loads(json.dumps(peer.workload(run, steps=1)))  # what the Flower side reads back
    specs = [fedavg_site.spec_from_dict(fields) for fields in load["sites"]]
    assert [s.name for s in specs] == run.site_names and {s.steps for s in specs} == {1}
    rebuilt = {s.name: fedavg_site.partition_digest(fedavg_site.site_data(s)) for s in specs}
    assert rebuilt == load["digests"] and len(set(rebuilt.values())) == 2  # same partitions, and two different ones


def test_a_site_s_optimizer_state_survives_the_trip_through_flower_s_context() -> None:
    overhead = load_benchmark("overhead")
    run = overhead.build_run(overhead.parse_args(["--model", "cnn", "--data", "synthetic:n=120", "--steps", "1"]), 2)
    spec = fedavg_site.site_specs(run, steps=1)[0]
    site = fedavg_site.FedAvgSite(spec)
    state, timing = site.round(fedavg_site.initial_state(spec))
    assert timing["images"] > 0 and timing["work"] >= timing["train"] > 0
    saved = site.optimizer_state()
    fresh = fedavg_site.FedAvgSite(spec)
    fresh.load_optimizer_state(saved)
    assert saved.keys() == fresh.optimizer_state().keys()
    for key, value in saved.items():
        np.testing.assert_array_equal(fresh.optimizer_state()[key], value)


FEDAVG_LOG = """\
2026-11-26 10:41:50,000 - FedAvg - INFO - [identity=simulator_server, run=simulate_job, wf=controller] -
--------------------------------------------------------------------------------
                                Round 0 started.
--------------------------------------------------------------------------------
2026-11-26 10:41:52,500 - FedAvg - INFO - [identity=simulator_server] - Aggregated 2/2 results
2026-11-26 10:41:53,000 - FedAvg - INFO - [identity=simulator_server, run=simulate_job, wf=controller] -
                                Round 1 started.
2026-11-26 10:41:56,250 - FedAvg - INFO - [identity=simulator_server, run=simulate_job, wf=controller] -
                                Finished FedAvg.
"""


def test_flare_s_own_fedavg_rounds_come_from_its_banners_and_the_sites_lines(tmp_path: Path) -> None:
    from datetime import datetime

    (tmp_path / "ws" / "flare-fedavg" / "server").mkdir(parents=True)
    (tmp_path / "ws" / "flare-fedavg" / "server" / "log.txt").write_text(FEDAVG_LOG)
    result = tmp_path / "flare-sim.json"
    at = datetime(2026, 11, 26, 10, 41, 50).timestamp()
    for name, work in (("site-1", 1.0), ("site-2", 2.0)):
        lines = [{"round": r, "entered_at": at + 3 * r + 0.5, "left_at": at + 3 * r + 0.5 + work, "work": work}
                 for r in (0, 1)]
        Path(f"{result}.{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rounds = peer.flare_rounds(tmp_path / "ws", result, ["site-1", "site-2"])
    assert [r["started_at"] - at for r in rounds] == [0.0, 3.0]
    assert [r["aggregated_at"] - at for r in rounds] == [3.0, 6.25]  # the next start; the last: FedAvg finished
    figures = peer.normalise("flare-sim", {"rounds": rounds}, 100)
    assert figures["walls"] == pytest.approx([3.0, 3.25]) and figures["work"] == [[1.0, 2.0], [1.0, 2.0]]
    assert figures["bytes_up"] is None and figures["parts"]["dispatch"] == pytest.approx(0.5)


def test_medflare_s_distance_to_flare_s_own_fedavg_is_reported() -> None:
    sides = {"bare": measured(8.0), "medflare-sim": measured(9.0), "flare-sim": measured(11.0)}
    compared = peer.compare(sides)
    assert compared["floors"]["medflare-sim"]["gap_seconds"] == pytest.approx(-2.0)
    table = peer.markdown({}, {"cell": compared})
    assert "medflare-sim against FLARE's own FedAvg (flare-sim): -2.00 s/round" in table


def test_the_server_s_memory_growth_is_measured_on_both_simulator_sides_and_set_against_flare_s() -> None:
    """The server is the process that started FLARE's simulator workers; its high-water mark at the end of round 3
    against the last round's (scaling.py's measure): medflare's side 100 -> 110 MB (+10 %), FLARE's own 100 -> 104."""
    scaling = load_benchmark("scaling")
    starts = [100.0 + 10 * r for r in range(5)]

    def traces(last_mb: float) -> dict:
        marks = [90, 95, 100, 100, last_mb]  # MB at the end of rounds 1..5
        server = [(start + 9.0, int(mb * 1e6), int(mb * 1e6)) for start, mb in zip(starts, marks)]
        worker = scaling.ProcessTrace(1, ["python", "-m", "nvflare.private.fed.app.simulator.simulator_worker",
                                          "--client", "site-1"], [(starts[0], 10**8, 10**8)])
        return {1: scaling.ProcessTrace(0, ["nvflare", "simulator"], server), 2: worker}

    medflare = peer.server_memory("medflare-sim", traces(110), [{"started_at": s, "wall": 10.0} for s in starts])
    flare = peer.server_memory("flare-sim", traces(104), [{"started_at": s, "aggregated_at": s + 10.0} for s in starts])
    assert medflare["growth_after_round_3"] == pytest.approx(0.10) and flare["growth_after_round_3"] == pytest.approx(0.04)
    assert peer.server_memory("bare", traces(110), []) is None  # no server there
    sides = {"medflare-sim": {**measured(9.0), "server_memory": medflare}, "flare-sim": {**measured(11.0),
                                                                                           "server_memory": flare}}
    table = peer.markdown({}, {"cell": peer.compare(sides)})
    assert "the server's memory after round 3 grew +10.0 % against FLARE's +4.0 % (goal <= 5 %)" in table


def test_a_side_that_hangs_is_ended_at_its_timeout_and_reported_not_fatal(tmp_path: Path) -> None:
    import sys
    import time

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ended after the side timeout of 1 s"):
        peer.run_side("flower-deploy", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "log",
                      tmp_path / "result.json", timeout=1.0)
    assert time.monotonic() - started < 20
    compared = {**peer.compare({"bare": measured(8.0), "medflare-poc": measured(9.0)}),
                "failed": {"flower-deploy": "flower-deploy failed (ended after the side timeout of 1 s)"}}
    table = peer.markdown({}, {"cell": compared})
    assert "- flower-deploy: **failed**, no figures (flower-deploy failed" in table
    assert "deployment:" not in table  # no goal is read from a pair with a failed side


def test_a_side_gets_absolute_paths_because_flare_s_sites_run_in_their_own_folders() -> None:
    env = peer.side_env(Path("runs/x/workload.json"), Path("runs/x/flare-sim.json"))
    assert Path(env[peer.WORKLOAD_ENV]).is_absolute() and Path(env[peer.RESULT_ENV]).is_absolute()


def test_a_side_ends_what_it_left_behind_and_spares_its_callers_other_children(tmp_path: Path) -> None:
    """A test session running a side in its own process had its other children (the warm-start server) ended."""
    import subprocess
    import sys

    import psutil

    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    result = tmp_path / "result.json"
    side = ("import json, subprocess, sys; left = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)'], start_new_session=True); json.dump({{'left': left.pid}}, open({str(result)!r}, 'w'))")
    try:
        with pytest.raises(KeyError):  # no "rounds" in this side's record: read after the processes are ended
            peer.run_side("bare", [sys.executable, "-c", side], {}, tmp_path / "log", result, timeout=60.0)
        left = json.loads(result.read_text())["left"]
        assert not psutil.pid_exists(left) or psutil.Process(left).status() == psutil.STATUS_ZOMBIE
        assert own.poll() is None  # the caller's own child lives, and its exit status is still the caller's
    finally:
        own.kill()
        assert own.wait(timeout=10) == -9


def test_a_run_ended_after_its_first_side_keeps_that_side_s_row(tmp_path: Path, monkeypatch) -> None:
    """A benchmark cut by its time limit (seen on a GPU lease) must not lose the sides that finished."""
    bare = {"rounds": [{"wall": wall, "sites": [{"work": wall - 0.5}]} for wall in (4.0, 2.0, 2.2)]}

    def run_side(side, command, env, log, result, timeout):
        if side == "bare":
            return {"raw": bare, "measured": {"total_seconds": 30.0, "cpu_seconds": 40.0, "peak_rss_bytes": 2**30}}
        raise KeyboardInterrupt  # the run is ended while its second side runs

    monkeypatch.setattr(peer, "run_side", run_side)
    monkeypatch.setattr(peer, "adopt_orphans", lambda: None)
    with pytest.raises(KeyboardInterrupt):
        peer.main(NO_FLOWER + ["--sides", "bare", "medflare-sim", "--models", "cnn", "--rounds", "3",
                               "--out", str(tmp_path)])
    kept = json.loads((tmp_path / "results.json").read_text())["cells"]["cnn, 2 sites"]["sides"]
    assert list(kept) == ["bare"] and kept["bare"]["round_seconds"] == pytest.approx(2.1)
    assert "| bare | " in (tmp_path / "results.md").read_text()


def test_a_failed_side_names_its_log_in_the_table_and_shows_the_log_s_end(tmp_path: Path, monkeypatch,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """Seen on a GPU lease: the table's one line ended in "last lines of ...:" with the lines themselves lost."""
    import sys

    log = tmp_path / "side.log"
    with pytest.raises(RuntimeError) as failure:
        peer.run_side("bare", [sys.executable, "-c", "print('boom', flush=True); raise SystemExit(3)"], {}, log,
                      tmp_path / "result.json", timeout=60.0)
    first, *tail = str(failure.value).splitlines()
    assert first == f"bare failed (exit 3); its log: {log}" and tail == ["boom"]

    def run_side(side, command, env, log, result, timeout):
        raise failure.value

    monkeypatch.setattr(peer, "run_side", run_side)
    monkeypatch.setattr(peer, "adopt_orphans", lambda: None)
    peer.main(NO_FLOWER + ["--sides", "bare", "--models", "cnn", "--rounds", "2", "--out", str(tmp_path / "out")])
    assert "    | boom" in capsys.readouterr().out
    assert f"- bare: **failed**, no figures (bare failed (exit 3); its log: {log})" in \
        (tmp_path / "out" / "results.md").read_text()
