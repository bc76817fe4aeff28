"""The fair-overhead benchmark's arithmetic on hand-made rounds (the benchmark itself runs for minutes)."""

import numpy as np
import pytest

from medflare.ops import weighted_average

from .conftest import load_benchmark

overhead = load_benchmark("overhead")


def flare_results() -> dict:
    """Two rounds as the controller records them: start times, per-site result arrival, server spans."""
    return {"rounds": [
        {"round": 0, "started_at": 100.0, "wall_seconds": 9.0, "server_seconds": {"aggregate": 0.2},
         "sites": {"site-1": {"result_at": 8.5, "train_seconds": 5.0}, "site-2": {"result_at": 7.0, "train_seconds": 4.0}}},
        {"round": 1, "started_at": 110.0, "wall_seconds": 5.5, "server_seconds": {"aggregate": 0.2, "checkpoint": 0.1},
         "sites": {"site-1": {"result_at": 5.2, "train_seconds": 4.0}, "site-2": {"result_at": 4.9, "train_seconds": 4.0}}},
    ]}


SPANS = {
    "site-1": {0: {"evaluate": 1.0, "train": 5.0, "encode": 0.5}, 1: {"evaluate": 0.5, "train": 4.0, "encode": 0.3}},
    "site-2": {0: {"evaluate": 1.0, "train": 4.0, "encode": 0.5}, 1: {"evaluate": 0.5, "train": 4.0, "encode": 0.2}},
}


def test_round_wall_runs_to_the_next_rounds_start_and_work_sums_the_sites_spans() -> None:
    rounds = overhead.flare_rounds(flare_results(), SPANS)
    assert [r["wall"] for r in rounds] == [10.0, 5.5]  # start-to-start, then the last round's own wall
    assert rounds[1]["work"] == pytest.approx({"site-1": 4.8, "site-2": 4.7})
    assert overhead.coordination(rounds, lambda r: list(r["work"].values())) == pytest.approx([3.5, 0.7])


def test_coordination_time_is_split_into_transport_server_and_the_rest() -> None:
    parts = overhead.where_it_goes(overhead.flare_rounds(flare_results(), SPANS))
    # round 2, slowest site-1: work 4.8, result at 5.2 -> transport 0.4; server on the round's path: aggregate 0.2
    # (the checkpoint's 0.1 runs while the sites train the next round); other 5.5 - 4.8 - 0.4 - 0.2
    assert parts["transport"] == pytest.approx(0.4)
    assert parts["server.aggregate"] == pytest.approx(0.2) and parts["server.checkpoint"] == pytest.approx(0.1)
    assert parts["site.encode"] == pytest.approx(0.3)
    assert parts["other"] == pytest.approx(0.1)


def test_trainer_images_follow_medflare_s_drop_last_and_step_cap() -> None:
    assert overhead.trained_images(2354, 64, 0) == 36 * 64
    assert overhead.trained_images(2354, 64, 5) == 5 * 64
    assert overhead.trained_images(40, 64, 0) == 40  # one short batch, kept


def test_throughput_counts_rounds_after_the_first() -> None:
    bare = [{"sites": [{"images": 999, "train": 1.0}]}, {"sites": [{"images": 128, "train": 2.0}, {"images": 128, "train": 2.0}]}]
    assert overhead.throughput(bare) == pytest.approx(64.0)
    rounds = overhead.flare_rounds(flare_results(), SPANS)
    assert overhead.throughput(rounds, {"site-1": 320, "site-2": 320}) == pytest.approx(80.0)


def test_the_bare_average_is_medflare_s_weighted_average() -> None:
    rng = np.random.default_rng(1)
    states = [{"w": rng.normal(size=(3, 2)).astype(np.float32), "n": np.array(k, np.int64)} for k in (4, 7)]
    ours = overhead.average(states, [30, 10])
    theirs = weighted_average({"a": states[0], "b": states[1]}, {"a": 30.0, "b": 10.0})
    np.testing.assert_allclose(ours["w"], theirs["w"], atol=1e-7)
    assert ours["n"].dtype == np.int64 and int(ours["n"]) == int(theirs["n"]) == 5


def test_quick_mode_is_small_and_the_issue_s_one_site_command_parses() -> None:
    quick = overhead.parse_args(["--quick"])
    assert (quick.clients, quick.rounds, quick.steps) == ([2], 3, 5)
    one = overhead.parse_args("--clients 1 --rounds 6 --steps 20 --model resnet18".split())
    run = overhead.build_run(one, one.clients[0])
    assert (run.clients, run.rounds, run.train["max_steps"], run.model) == (1, 6, 20, "resnet18")


def test_a_poc_table_says_poc_and_leaves_the_uncounted_cpu_seconds_blank() -> None:
    figures = {"bare_round_seconds": 10.0, "flare_round_seconds": 10.5, "round_ratio_without_startup": 1.05,
               "wall_ratio_with_startup": 1.2, "coordination_seconds_per_round": {"bare": 0.3, "flare": 0.6},
               "train_images_per_second": {"bare": 250.0, "flare": 245.0}, "throughput_ratio": 0.98,
               "first_round_over_later": {"bare": 1.0, "flare": 1.5}, "cpu_seconds": {"bare": 200.0, "flare": None},
               "bytes_per_site_round_over_fp32_model": 1.001, "flare_coordination_parts": {"transport": 0.4},
               "goals_met": {}}
    table = overhead.markdown({"env": "poc"}, {"2": figures})
    assert table.startswith("# Framework cost: medflare in a FLARE POC")
    assert "| 200 / - |" in table
    assert "ratio 1.05 (goal <= 1.05): met, 0 to spare" in table  # every goal, met or missed and by how much
    assert "coordination 0.6 s (goal <= 0.3 s): **missed** by 0.3 s" in table
    simulated = {**figures, "cpu_seconds": {"bare": 200.0, "flare": 210.0}}
    assert "FLARE's simulator" in overhead.markdown({"env": "sim"}, {"2": simulated})
