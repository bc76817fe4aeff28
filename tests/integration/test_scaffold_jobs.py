"""SCAFFOLD as a job: the in-process loop (``benchmarks/inprocess.py``, the plan and round core FLARE's simulator
runs) and FLARE's simulator itself. The server's c reaches every site with every train task, Δc_i comes back beside
the weights, c_i never leaves a site, and c is the bounded-share average of the sites' c_i (Algorithm 1: with c and
every c_i starting at 0, all sites answering and fixed shares, c = Σ_i s_i c_i after every round)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from medflare import contracts
from medflare.console.simulate import run_simulation
from medflare.methods.scaffold.control import DELTA_CONTROL, SERVER_CONTROL
from medflare.plan import resolve
from tests.benchmarks.conftest import load_benchmark

from ._smoke import check_audit, smoke_run
from .test_every_method_simulator import audit_records

METHOD = "scaffold"


def tiny_job(rounds: int = 3):
    return dataclasses.replace(smoke_run(METHOD), rounds=rounds, clients=2)


def test_in_process_c_is_the_bounded_share_average_of_the_sites_c_i_and_c_i_stays_home() -> None:
    engine = load_benchmark("inprocess")
    plan = resolve(tiny_job(), "byoc")
    tasks, sent, own = [], [], {}  # train tasks; train results; site -> its flat c_i after each round

    def deliver(runtime, task_name: str, arrays: dict, header: dict):
        result = engine.run_at_site(runtime, task_name, arrays, header)
        if task_name == contracts.TRAIN_PHASE:
            tasks.append(arrays)
            sent.append(result[0])
            own.setdefault(runtime.site_name, []).append(runtime.trainer._flatten(runtime.trainer.control))
        return result

    rounds = []
    engine.run_rounds(plan, deliver=deliver, on_round=rounds.append)

    model_keys = {k for k in tasks[0] if k != SERVER_CONTROL}
    assert all(set(task) == model_keys | {SERVER_CONTROL} for task in tasks)  # c came with every train task
    for result in sent:
        assert set(result) == model_keys | {DELTA_CONTROL}  # the weights and Δc_i, nothing else
    for site, history in own.items():  # c_i is not anything a result carried
        assert not any(np.allclose(result[DELTA_CONTROL], c_i) for c_i in history[1:] for result in sent), site
    np.testing.assert_array_equal(tasks[0][SERVER_CONTROL], 0)
    sites = sorted(own)
    for index, done in enumerate(rounds[:-1]):  # c sent in round r+1 = Σ_i s_i c_i after round r
        expected = sum(done.aggregate.shares[site] * own[site][index].astype(np.float64) for site in sites)
        received = tasks[(index + 1) * len(sites)][SERVER_CONTROL]
        np.testing.assert_allclose(received, expected, rtol=1e-4, atol=1e-6)
        assert np.linalg.norm(received) > 0


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy: about a minute on 2 cores
def test_scaffold_in_flares_simulator_sends_c_and_delta_c_and_never_c_i(tmp_path: Path) -> None:
    run = dataclasses.replace(tiny_job(rounds=2), audit=True)
    out = tmp_path / "scaffold"
    summary = run_simulation(resolve(run, "byoc"), out, echo=lambda line: None)

    assert not summary.get("error"), summary["error"]
    assert [entry["control_norm"] > 0 for entry in summary["per_round"]] == [True, True]
    for site in ("site-1", "site-2"):
        records = audit_records(out, site)
        trains = [r for r in records if r["direction"] == "task" and r["task"] == contracts.TRAIN_PHASE]
        model_keys = [k for k in trains[0]["arrays"] if k != SERVER_CONTROL]
        assert check_audit(records, METHOD, model_keys) == {"train": 2, "validate": 1}
        assert all(SERVER_CONTROL in r["arrays"] for r in trains)
        results = [r for r in records if r["direction"] == "result" and r["task"] == contracts.TRAIN_PHASE]
        assert all(set(r["arrays"]) == set(model_keys) | {DELTA_CONTROL} for r in results)
