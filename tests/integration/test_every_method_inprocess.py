"""Every registered method's smoke job through the in-process federated loop (``benchmarks/inprocess.py``): the plan
``medflare run`` writes into the simulator's job, each site built as the executor builds it, and the round core that
FLARE's aggregator drives, with the job's arguments. It plays every round of the plan, every site's result passes
the server's checks, each site sends exactly what the method's Payload declares, and the job trains. New methods
are covered with no new test; FLARE's simulator runs the same jobs in ``make test-heavy``
(``test_every_method_simulator.py``)."""

from types import ModuleType

import numpy as np
import pytest
import torch

from medflare.plan import resolve
from medflare.registry import get_method, list_methods
from tests.benchmarks.conftest import load_benchmark

from ._smoke import check_audit, smoke_run


@pytest.fixture(scope="module")
def engine() -> ModuleType:
    return load_benchmark("inprocess")


def snapshot(runtime) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in runtime.model.state_dict().items()}


@pytest.mark.parametrize("method", list_methods())
def test_methods_smoke_job_plays_its_plan_in_process_and_sends_exactly_its_declaration(
    method: str, engine: ModuleType
) -> None:
    run = smoke_run(method)
    plan = resolve(run, "byoc")
    records: dict[str, list[dict]] = {site.name: [] for site in plan.sites}
    first_state: dict[str, dict[str, torch.Tensor]] = {}
    runtimes = {}

    def deliver(runtime, task_name: str, arrays: dict, header: dict) -> tuple[dict, dict]:
        site = runtime.site_name
        runtimes[site] = runtime
        first_state.setdefault(site, snapshot(runtime))
        records[site].append({"direction": "task", "task": task_name, "arrays": list(arrays), "header": header})
        result = engine.run_at_site(runtime, task_name, arrays, header)
        records[site].append({"direction": "result", "task": task_name, "arrays": list(result[0]), "meta": result[1]})
        return result

    rounds = []
    params, evaluations = engine.run_rounds(plan, deliver=deliver, on_round=rounds.append)

    assert [(done.plan.round, done.plan.stage) for done in rounds] == [(r.round, r.stage) for r in plan.rounds]
    names = [site.name for site in plan.sites]
    assert all(sorted(u.site for u in done.accepted) == names for done in rounds)  # every site passed every check
    global_keys = list(params)
    for site in names:
        checked = check_audit(records[site], method, global_keys)
        assert checked["train"] == len(plan.rounds) and checked["validate"] == 1, checked
        phases = {phase for step in plan.rounds for phase in step.phases} | {"validate"}
        assert set(checked) == phases, (checked, phases)  # a result for every phase the plan sends
        # the final model was scored on every labelled image of the site's test split
        test_split = runtimes[site].data.test
        assert evaluations[site]["test"].count == len(test_split) > 0
        trained = snapshot(runtimes[site])
        assert any(not torch.equal(first_state[site][k], trained[k]) for k in trained), f"{site}'s model never changed"
    if get_method(method).server_model:  # the server's model moved too
        initial = engine.global_model_of(plan).state_dict()
        assert any(not np.array_equal(initial[k].numpy(), params[k]) for k in params if params[k].dtype.kind == "f")
