"""A benchmark cell is reused only when an identical run finished; anything else runs again."""

import json
import os
from pathlib import Path
from typing import Any

import benchmarking
import pytest
from benchmarking import fingerprint_file, goal_verdict, mean_std, run_cell, versus

import medflare.console.simulate
from medflare.run_config import RunConfig


def fake_simulation(calls: list[RunConfig]) -> Any:
    """Stands in for ``run_simulation``: writes a summary carrying the run's seed, as a finished run would."""

    def run(run: RunConfig, out_dir: Path, echo: Any, overwrite: bool) -> dict[str, Any]:
        assert overwrite  # a cell's folder is medflare's own and is replaced when redone
        calls.append(run)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        summary = {"seed": run.seed}
        (Path(out_dir) / "summary.json").write_text(json.dumps(summary))
        return summary

    return run


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[RunConfig]:
    made: list[RunConfig] = []
    monkeypatch.setattr(medflare.console.simulate, "run_simulation", fake_simulation(made))
    return made


def test_an_identical_finished_run_is_reused_and_a_changed_one_runs_again(tmp_path: Path, calls: list) -> None:
    cell = tmp_path / "fedavg-seed0"
    first, again = RunConfig(method="fedavg", seed=0, rounds=2), RunConfig(method="fedavg", seed=0, rounds=2)
    assert run_cell(first, cell, echo=lambda line: None) == ({"seed": 0}, False)
    assert run_cell(again, cell, echo=lambda line: None) == ({"seed": 0}, True) and len(calls) == 1
    assert run_cell(RunConfig(method="fedavg", seed=0, rounds=3), cell, echo=lambda line: None)[1] is False
    assert run_cell(again, cell, reuse=False, echo=lambda line: None)[1] is False and len(calls) == 3
    assert fingerprint_file(cell).parent == tmp_path  # the record sits beside the run, not among its files


def test_a_run_without_its_record_or_summary_is_not_reused(tmp_path: Path, calls: list) -> None:
    run, cell = RunConfig(method="fedavg", seed=1, rounds=2), tmp_path / "cell"
    run_cell(run, cell, echo=lambda line: None)
    (cell / "summary.json").unlink()  # say a run stopped before its outputs
    assert run_cell(run, cell, echo=lambda line: None)[1] is False
    fingerprint_file(cell).unlink()
    assert run_cell(run, cell, echo=lambda line: None)[1] is False and len(calls) == 3


def test_mean_std_is_the_sample_deviation() -> None:
    assert mean_std([0.7, 0.8]) == pytest.approx((0.75, 0.0707107), abs=1e-6)
    assert mean_std([0.5]) == (0.5, 0.0) and mean_std([]) is None


def test_versus_reads_a_gap_within_one_std_as_no_difference() -> None:
    # means 0.75 and 0.70, stds 0.0707 and 0.01: the 0.05 gap is inside the larger spread
    assert versus([0.7, 0.8], [0.69, 0.71]) == "+0.050 (no difference)"
    # tight spreads (0.01 each): the same 0.05 gap counts, both ways
    assert versus([0.74, 0.76], [0.69, 0.71]) == "+0.050 (above)"
    assert versus([0.69, 0.71], [0.74, 0.76]) == "-0.050 (below)"
    assert versus([0.9], [0.5]).endswith("(one seed: not a result)")
    with pytest.raises(ValueError):
        versus([], [0.5])


def test_goal_verdict_marks_met_or_missed_and_by_how_much() -> None:
    assert goal_verdict("ratio", 1.104, 1.05) == "ratio 1.104 (goal <= 1.05): **missed** by 0.054"
    assert goal_verdict("ratio", 1.02, 1.05) == "ratio 1.02 (goal <= 1.05): met, 0.03 to spare"
    assert goal_verdict("throughput", 0.93, 0.95, at_most=False) == "throughput 0.93 (goal >= 0.95): **missed** by 0.02"
    assert goal_verdict("growth", 8.4, 5.0, unit=" %") == "growth 8.4 % (goal <= 5 %): **missed** by 3.4 %"
    assert goal_verdict("growth", None, 5.0) == "growth (goal <= 5): not measured"


def test_the_cpu_is_named_by_its_model_and_the_cores_this_process_may_use(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n")
    cores = len(os.sched_getaffinity(0))
    assert benchmarking.cpu_model(cpuinfo) == f"AMD EPYC 7B13, {cores} cores"
    assert benchmarking.cpu_model(tmp_path / "absent").endswith(f", {cores} cores")  # no /proc: the platform's name
