"""The server optimizer (``server_optimizer``, docs/server-optimizers.md) in a real job: FedAdam through the in-process
engine (``benchmarks/inprocess.py``: the plan, the sites as the executor builds them, the round core FLARE's
aggregator drives) and through FLARE's simulator; what the sites receive; the plan-time refusals; a hostile site's
step under the defences with FedAdam."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from medflare import contracts
from medflare.errors import ConfigError
from medflare.plan import PLAN_FILE, RunPlan, read_plan, resolve, write_plan
from medflare.run_config import RunConfig
from medflare.server_round import SERVER_OPT_INFO, RoundAggregation
from tests.benchmarks.conftest import load_benchmark

FEDADAM = {"name": "fedadam", "lr": 0.05}
TINY = RunConfig(method="fedavg", rounds=2, clients=2, data={"source": "synthetic:n=120,n_val=30,n_test=30"},
                 train={"max_steps": 2, "batch_size": 16}, server_optimizer=FEDADAM)


@pytest.fixture(scope="module")
def engine() -> ModuleType:
    return load_benchmark("inprocess")


def adam_by_hand(rounds: list, start: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Reddi et al. 2021, Algorithm 2 (FedAdam), written out over each round's accepted updates: Δ = the
    sample-weighted mean − the global model, m = 0.9m + 0.1Δ, v = 0.99v + 0.01Δ² (v₋₁ = τ²), x += η m/(√v + τ)."""
    eta, tau, x, m, v, models = FEDADAM["lr"], 1e-3, dict(start), {}, {}, []
    for done in rounds:
        n = np.array([float(u.meta[contracts.N_SAMPLES]) for u in done.accepted])
        following = dict(x)
        for key, value in x.items():
            mean = sum(w * u.arrays[key].astype(np.float64) for w, u in zip(n / n.sum(), done.accepted))
            if value.dtype.kind != "f":  # an integer buffer: the plain average
                following[key] = np.rint(mean).astype(value.dtype)
                continue
            delta = mean - value.astype(np.float64)
            m[key] = 0.9 * m.get(key, 0.0) + 0.1 * delta
            v[key] = 0.99 * v.get(key, tau ** 2) + 0.01 * delta ** 2
            following[key] = (value + eta * m[key] / (np.sqrt(v[key]) + tau)).astype(value.dtype)
        x = following
        models.append(x)
    return models


def test_fedadam_through_the_in_process_engine_steps_the_global_model_by_algorithm_2(engine: ModuleType) -> None:
    plan = resolve(TINY, "byoc")
    assert plan.server_optimizer == {"name": "fedadam", "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "lr": 0.05}
    received: dict[str, list[dict[str, np.ndarray]]] = {site.name: [] for site in plan.sites}

    def deliver(runtime, task_name: str, arrays: dict, header: dict) -> tuple[dict, dict]:
        received[runtime.site_name].append({k: np.array(v) for k, v in arrays.items()})
        return engine.run_at_site(runtime, task_name, arrays, header)

    rounds: list = []
    params, _ = engine.run_rounds(plan, deliver=deliver, on_round=rounds.append)
    start = {k: v.numpy() for k, v in engine.global_model_of(plan).state_dict().items()}
    expected = adam_by_hand(rounds, start)
    for done, model in zip(rounds, expected):
        assert done.aggregate.info[SERVER_OPT_INFO] == {"name": "fedadam", "lr": 0.05}
        for key, value in model.items():
            np.testing.assert_allclose(done.aggregate.params[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    # FedAdam's step is not the plain mean: the first round's model differs from the mean of what the sites sent
    key = next(k for k, v in start.items() if v.dtype.kind == "f")
    mean = np.mean([u.arrays[key] for u in rounds[0].accepted], axis=0)
    assert not np.allclose(rounds[0].aggregate.params[key], mean)
    # what each site received: the global model's keys and values, every round; no optimizer buffer travels
    for site, tasks in received.items():
        assert [set(arrays) for arrays in tasks] == [set(start)] * 3, site  # two train rounds, then the validation
        for arrays, model in zip(tasks, [start, *[done.aggregate.params for done in rounds]]):
            for key, value in arrays.items():
                np.testing.assert_array_equal(value, np.asarray(model[key]).astype(value.dtype), err_msg=key)
    assert set(params) == set(start)


@pytest.mark.parametrize("method", ["local-only", "mdhfl", "fedmd"])
def test_a_method_without_a_server_model_refuses_a_server_optimizer_at_plan_time(method: str) -> None:
    run = dataclasses.replace(TINY, method=method, model="")
    with pytest.raises(ConfigError, match=f"method '{method}' has no global model on the server"):
        resolve(run, "byoc", check_files=False)


def test_encrypted_aggregation_refuses_a_server_optimizer_at_plan_time() -> None:
    run = dataclasses.replace(TINY, secure_aggregation="he", data={"source": "site"},
                              task={"num_classes": 2, "in_channels": 1, "image_size": 28})
    with pytest.raises(ConfigError, match="secure_aggregation=he keeps it encrypted"):
        resolve(run, "byoc", check_files=False)


def test_an_edited_plan_with_a_refused_server_optimizer_is_refused_where_it_is_read(tmp_path: Path) -> None:
    """A plan edited after export (a server optimizer added to local-only) is refused by read_plan and by the round
    core, not applied."""
    plan = resolve(dataclasses.replace(TINY, method="local-only", model="", server_optimizer={}), "byoc")
    write_plan(plan, tmp_path)
    record = json.loads((tmp_path / PLAN_FILE).read_text())
    record["plan"]["server_optimizer"] = {"name": "fedyogi"}
    (tmp_path / PLAN_FILE).write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="no global model on the server"):
        read_plan(tmp_path / PLAN_FILE)
    with pytest.raises(ConfigError, match="no global model on the server"):
        RoundAggregation(plan.spec, plan.method_cfg, 2, 2, server_optimizer={"name": "fedyogi"})


def test_a_plan_without_a_server_optimizer_records_none_and_reads_back() -> None:
    plan = resolve(dataclasses.replace(TINY, server_optimizer={}), "byoc")
    assert "server_optimizer" not in plan.to_dict() and RoundAggregation.of_plan(plan).server_opt is None
    again = RunPlan.from_dict(resolve(TINY, "byoc").to_dict())
    assert again.server_opt.name == "fedadam" and RoundAggregation.of_plan(again).server_opt is not None


def test_a_hostile_sites_scaled_step_under_the_defences_is_what_fedadam_steps_on() -> None:
    """tests/flare/test_adversarial_site.py's x1000 step from the third site, with the norm bound and the share cap on:
    the server optimizer steps on what the defences left (here: the honest sites; the norm bound drops the attacker), so the
    FedAdam model is exactly the FedAdam step from the honest sites' bounded aggregate, and finite."""
    from tests.flare import test_adversarial_site as adversarial

    torch.manual_seed(0)
    _, rounds = adversarial.honest_job("fedavg")
    round_ = rounds[0]
    position = len(round_.phases) - 1
    forged = adversarial.scaled(round_, contracts.TRAIN_PHASE, round_.results[position][adversarial.ATTACKER])
    plain = adversarial.replay(round_, {position: {adversarial.ATTACKER: forged}})
    start = copy.deepcopy(round_.start)
    with_adam = RoundAggregation(start.spec, {}, start.num_classes, 2, adversarial.ROBUST, server_optimizer=FEDADAM)
    start.server_opt = with_adam.server_opt
    stepped = adversarial.replay(dataclasses.replace(round_, start=start), {position: {adversarial.ATTACKER: forged}})
    honest = [round_.results[position][site][0] for site in ("site-1", "site-2")]
    for key, before in round_.start.global_params.items():
        if before.dtype.kind != "f":
            np.testing.assert_array_equal(stepped.params[key], plain.params[key])
            continue
        low, high = np.minimum(honest[0][key], honest[1][key]), np.maximum(honest[0][key], honest[1][key])
        assert np.all((plain.params[key] >= low - 1e-6) & (plain.params[key] <= high + 1e-6)), key  # attacker dropped
        delta = plain.params[key].astype(np.float64) - before.astype(np.float64)
        step = 0.05 * 0.1 * delta / (np.sqrt(0.99e-6 + 0.01 * delta ** 2) + 1e-3)
        np.testing.assert_allclose(stepped.params[key], before + step, rtol=1e-5, atol=1e-7, err_msg=key)
        assert np.all(np.isfinite(stepped.params[key]))


def aggregated_round(core: RoundAggregation, params: dict, index: int, value: float) -> dict[str, np.ndarray]:
    """One round of one site sending ``value`` everywhere."""
    from medflare.methods.base import RoundContext

    core.start_round(params, RoundContext(index, 4))
    core.start_phase(contracts.TRAIN_PHASE)
    assert core.accept("site-1", {"w": np.full((2, 3), value, np.float32)}, {"n_samples": 5}) is None
    return core.aggregate().params


def test_a_resumed_job_continues_the_server_optimizers_buffers_from_the_checkpoint(tmp_path: Path) -> None:
    """The round checkpoint (the server's own medflare_checkpoint.npz) carries m and v; a job resuming it by id
    takes the next step exactly as the crashed job would have (a fresh optimizer would step by another amount)."""
    from medflare.flare.controller import CHECKPOINT_FILE
    from medflare.flare.resume_state import save_round_checkpoint
    from medflare.ops.checkpoint import load_checkpoint
    from medflare.registry import get_method
    from tests.flare import test_controller_resume as resume_tests

    def fedyogi_core() -> RoundAggregation:
        return RoundAggregation(get_method("fedavg"), {}, 3, 4, server_optimizer={"name": "fedyogi", "lr": 0.1})

    crashed_core = fedyogi_core()
    job_id, crashed = resume_tests.crashed_job(tmp_path)  # the crashed job: 2 of 4 rounds, its model w = 3
    params = aggregated_round(crashed_core, {"w": np.zeros((2, 3), np.float32)}, 0, 2.0)
    params = aggregated_round(crashed_core, params, 1, 3.0)
    crashed.global_params = params
    app = tmp_path / job_id / "app_server"
    save_round_checkpoint(str(app), crashed.results, params, crashed._checkpoint_write, crashed_core.server_opt)
    crashed._checkpoint_write.wait()
    saved, _ = load_checkpoint(app / CHECKPOINT_FILE)
    assert set(saved) == {"w", "server_optimizer:m/w", "server_optimizer:v/w"}

    ctl, ctx = resume_tests.new_job(tmp_path, job_id)
    ctl.aggregator.core.server_opt = fedyogi_core().server_opt
    ctl._resume(ctx)
    assert set(ctl.global_params) == {"w"}  # the buffers stay out of the model the sites receive
    resumed_core = fedyogi_core()
    resumed_core.server_opt = ctl.aggregator.core.server_opt
    continued = aggregated_round(resumed_core, ctl.global_params, 2, 1.0)
    np.testing.assert_array_equal(continued["w"], aggregated_round(crashed_core, params, 2, 1.0)["w"])
    assert not np.allclose(continued["w"], aggregated_round(fedyogi_core(), params, 2, 1.0)["w"])


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy: one FLARE simulator run
def test_fedadam_through_flares_simulator_gives_the_in_process_engines_model(engine: ModuleType,
                                                                             tmp_path: Path) -> None:
    """The FLARE controller path (MedflareAggregator over the same round core) steps the global model as the
    in-process engine does: the simulator's final FL_global_model.pt is the engine's model after the same rounds, and
    each round's record names the server optimizer."""
    from medflare.console.simulate import run_simulation

    plan = resolve(TINY, "byoc")
    run_simulation(plan, tmp_path / "run", echo=lambda line: None)
    rounds = json.loads((tmp_path / "run" / "medflare_results.json").read_text())["rounds"]
    assert [record[SERVER_OPT_INFO] for record in rounds] == [{"name": "fedadam", "lr": 0.05}] * 2
    simulated = torch.load(tmp_path / "run" / "FL_global_model.pt", weights_only=False)["model"]
    in_process, _ = engine.run_rounds(plan)
    for key, value in in_process.items():
        np.testing.assert_allclose(simulated[key].numpy(), value, rtol=1e-5, atol=1e-6, err_msg=key)
