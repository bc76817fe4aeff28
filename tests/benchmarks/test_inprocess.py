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
