"""Early stopping and ``--resume`` through the command line and FLARE's simulator.

A run whose model cannot improve (a vanishing learning rate) stops after ``patience`` rounds, still scores its
final model, and records why. Resuming it continues the round counter and the weights: the resumed job starts
from exactly the previous last global model (same fingerprint, and the sites score it exactly as the previous
job's final validation did), and its summary covers every round.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from medflare.console.cli import main
from medflare.resume import model_digest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

COMMON = ["--data", "synthetic:n=300", "--clients", "2", "--max-steps", "2", "--batch-size", "32",
          "--set", "tracking=off"]
PATIENCE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    stopped, resumed = root / "stopped", root / "resumed"
    assert main(["run", "fedavg", "--rounds", "6", "--lr", "1e-12", "--set", f"patience={PATIENCE}",
                 "--out", str(stopped), *COMMON]) == 0
    assert main(["run", "fedavg", "--rounds", "5", "--lr", "0.05", "--resume", str(stopped),
                 "--out", str(resumed), *COMMON]) == 0
    return {"stopped": stopped, "resumed": resumed}


def read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def test_a_run_without_improvement_stops_after_patience_rounds_and_says_why(runs, capsys) -> None:
    summary = read(runs["stopped"], "summary.json")
    stopped = summary["stopped_early"]
    assert summary["rounds_completed"] == 1 + PATIENCE  # model 0 is the best; models 1 and 2 bring nothing
    assert stopped["after_round"] == 1 + PATIENCE and stopped["best_model_version"] == 0
    assert f"did not improve for {PATIENCE} rounds" in stopped["reason"]
    results = read(runs["stopped"], "medflare_results.json")
    assert results["final"]["model_version"] == 1 + PATIENCE  # the final validation still ran
    assert 0.0 <= summary["final"]["balanced_accuracy"] <= 1.0
    # the summary reports the final validation the server ran, not another model's score
    assert summary["final"]["balanced_accuracy"] == pytest.approx(results["final"]["test"]["balanced_accuracy"])


def test_the_resumed_job_starts_from_the_previous_last_global_model(runs) -> None:
    previous = torch.load(runs["stopped"] / "FL_global_model.pt", weights_only=True)["model"]
    results = read(runs["resumed"], "medflare_results.json")
    start = results["resumed"][0]
    assert start["start_round"] == 1 + PATIENCE
    assert start["from"] == str(runs["stopped"].resolve())
    assert start["initial_model_digest"] == model_digest({k: v.numpy() for k, v in previous.items()})
    before = read(runs["stopped"], "medflare_results.json")
    version = str(1 + PATIENCE)  # scored by the old job's final validation and again by the new job's first round
    assert results["evaluations"][version]["test_stats"] == before["evaluations"][version]["test_stats"]
    after = torch.load(runs["resumed"] / "FL_global_model.pt", weights_only=True)["model"]
    assert any(not torch.equal(after[k], previous[k]) for k in previous)  # and then it trained on


def test_the_resumed_summary_covers_every_round_with_one_counter(runs) -> None:
    before = read(runs["stopped"], "medflare_results.json")
    results = read(runs["resumed"], "medflare_results.json")
    assert [r["round"] for r in results["rounds"]] == list(range(5))
    assert results["rounds"][: 1 + PATIENCE] == before["rounds"]  # the old rounds, as they were
    assert sorted(int(v) for v in results["evaluations"]) == list(range(6))
    assert results["final"]["model_version"] == 5 and "stopped_early" not in results
    summary = read(runs["resumed"], "summary.json")
    assert summary["rounds_completed"] == 5
    with (runs["resumed"] / "rounds.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 6  # round 0 (the initial model) + 5 rounds
