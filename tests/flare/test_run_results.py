"""The controller's run record without FLARE (issue 50, item 3): the best model, early stopping, the checkpoint state a
resumed job restores, and what a resumed job may continue."""

from __future__ import annotations

import numpy as np
import pytest

from medflare.flare.resume_state import check_same_model, resumed_job_id
from medflare.flare.run_results import RunResults
from medflare.methods.base import RoundContext


def scored(run: RunResults, version: int, val: float, params: dict | None) -> None:
    run.record_evaluation(version, {"val": {"balanced_accuracy": val}}, params)


def test_only_a_better_validation_score_makes_the_best_model_and_waits_to_be_saved() -> None:
    run = RunResults("balanced_accuracy")
    first, worse = {"w": np.zeros(1)}, {"w": np.ones(1)}
    scored(run, 0, 0.6, first)
    scored(run, 1, 0.5, worse)
    assert run.data["best"] == {"model_version": 0, "balanced_accuracy": 0.6} and run.best_unsaved is first
    scored(run, 2, 0.7, None)  # an encrypted job's server: the score counts, there is nothing to save
    assert run.data["best"]["model_version"] == 2 and run.best_unsaved is first
    assert sorted(run.data["evaluations"]) == ["0", "1", "2"]


def test_the_run_stops_after_patience_scored_versions_without_a_better_one() -> None:
    run = RunResults("balanced_accuracy", patience=2)
    scored(run, 0, 0.6, None)
    assert run.stop_early(RoundContext(1, 10)) is None
    assert run.stop_early(RoundContext(2, 10, scored=False)) is None  # an unscored round never stops the run
    stopped = run.stop_early(RoundContext(2, 10))
    assert stopped is run.data["stopped_early"] and stopped["after_round"] == 3 and stopped["best_model_version"] == 0


def test_a_checkpoint_state_restores_into_a_run_of_the_same_job_only() -> None:
    run = RunResults("balanced_accuracy")
    run.data = {"method": "fedavg", "num_rounds": 4, "rounds": [{"round": 0}], "evaluations": {}}
    run.next_round, run.best = 1, 0.5
    resumed = RunResults("balanced_accuracy")
    resumed.restore(run.state(), "fedavg", 4)
    assert (resumed.next_round, resumed.best, resumed.data) == (1, 0.5, run.data)
    for method, rounds in (("fedprox", 4), ("fedavg", 5)):
        with pytest.raises(ValueError, match="another job"):
            RunResults("balanced_accuracy").restore(run.state(), method, rounds)


def test_resume_from_is_a_job_id_outside_the_simulator_and_the_model_must_match() -> None:
    job = "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert resumed_job_id(job, in_simulator=False) == job and resumed_job_id("runs/old", in_simulator=True) is None
    with pytest.raises(ValueError, match="must be the id of an earlier job"):
        resumed_job_id("runs/old", in_simulator=False)
    with pytest.raises(ValueError, match="differs"):
        check_same_model({"w": np.zeros((2, 3))}, {"w": np.zeros((3, 3))})
