"""The benchmarks' in-process engine: hooks once per result and per round, in order; every site aggregated and
evaluated; seeded; a refused result stops the job."""

from types import ModuleType

import numpy as np
import pytest

from medflare.run_config import RunConfig
from tests.benchmarks.conftest import load_benchmark


@pytest.fixture(scope="module")
def engine() -> ModuleType:
    return load_benchmark("inprocess")


def small_run() -> RunConfig:
    return RunConfig(method="fedavg", rounds=2, clients=2, model="cnn", site_evaluation="final",
                     data={"source": "synthetic:n=80,classes=3,n_val=8,n_test=8,size=16", "augment": "none"},
                     train={"max_steps": 1, "batch_size": 8})


def test_hooks_see_every_sites_result_and_every_round_in_order(engine: ModuleType) -> None:
    results, rounds = [], []
    params, evaluations = engine.run_rounds(small_run(), on_result=lambda plan, site, result: results.append(
        (plan.round, site)), on_round=rounds.append)

    assert results == [(0, "site-1"), (0, "site-2"), (1, "site-1"), (1, "site-2")]
    assert [done.plan.round for done in rounds] == [0, 1]
    assert all(sorted(u.site for u in done.accepted) == ["site-1", "site-2"] for done in rounds)
    assert params is rounds[-1].aggregate.params  # the last round's aggregate is the model evaluated
    assert set(evaluations) == {"site-1", "site-2"} and all(e is not None for e in evaluations.values())
    again, _ = engine.run_rounds(small_run())
    assert all(np.array_equal(params[k], again[k]) for k in params)  # seeded: the same job, the same model


def test_a_refused_result_stops_the_job_naming_the_site(engine: ModuleType) -> None:
    def broken(runtime, task_name, arrays, header):
        result, meta = engine.run_at_site(runtime, task_name, arrays, header)
        return {k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in result.items()}, meta

    with pytest.raises(RuntimeError, match="site-1 rejected in round 1"):
        engine.run_rounds(small_run(), deliver=broken)


def test_with_a_record_it_scores_each_received_model_and_stops_early_as_the_controller(engine: ModuleType) -> None:
    # a vanishing learning rate: model 0 stays the best, models 1 and 2 bring nothing, so patience 2 stops the
    # job after round 3 of 6 (as tests/integration/test_early_stop_and_resume.py shows FLARE's controller does)
    run = RunConfig(method="fedavg", rounds=6, clients=2, model="cnn", patience=2,
                    data={"source": "synthetic:n=80,classes=3,n_val=8,n_test=8,size=16", "augment": "none"},
                    train={"max_steps": 1, "batch_size": 8, "lr": 1e-12})
    results, rounds = engine.selecting(run), []
    engine.run_rounds(run, on_round=rounds.append, results=results)
    assert [done.plan.round for done in rounds] == [0, 1, 2]
    assert sorted(results.data["evaluations"], key=int) == ["0", "1", "2"]
    assert results.data["best"]["model_version"] == 0 and results.data["stopped_early"]["after_round"] == 3
    assert results.key_metric == "balanced_accuracy"
    scored = results.data["evaluations"]["0"]
    assert scored["sites"] == ["site-1", "site-2"] and scored["val_stats"]["count"] == 8 and "test" in scored


def test_with_a_record_a_learning_job_keeps_its_best_version_and_runs_to_the_cap(engine: ModuleType) -> None:
    run = RunConfig(method="fedavg", rounds=3, clients=2, model="cnn", patience=5,
                    data={"source": "synthetic:n=80,classes=3,n_val=8,n_test=8,size=16", "augment": "none"},
                    train={"max_steps": 2, "batch_size": 8, "lr": 1e-2})
    results = engine.selecting(run)
    engine.run_rounds(run, results=results)
    scores = {int(v): e["val"]["balanced_accuracy"] for v, e in results.data["evaluations"].items()}
    assert sorted(scores) == [0, 1, 2] and "stopped_early" not in results.data
    best = results.data["best"]
    assert best["balanced_accuracy"] == max(scores.values())
    assert best["model_version"] == min(v for v, s in scores.items() if s == max(scores.values()))
