"""Issue 60, item 1: the server proves its plan. Every task carries the server's plan fingerprint and the defences
it runs with; a site declines a task of another plan, of weaker defences than its policy requires, or without
proof; the server refuses a result of a site running another plan (tests/integration/test_server_plan_simulator.py
runs a misdeployed server app end to end)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.signal import Signal

from medflare import contracts
from medflare.flare import run_results
from medflare.flare.controller import MedflareController
from medflare.plan_proof import server_proof
from medflare.server_setup import RobustConfig

from .._plans import site_data_plan
from .test_executor import SITE_DATA, site_executor


def proved_task(meta: dict) -> object:
    return DXO(DataKind.WEIGHTS, data={}, meta={"round": 0, **meta}).to_shareable()


def executor_with_policy(tmp_path, monkeypatch, policy: dict):
    """A site-1 executor whose policy is ``policy``; training it would fail the test, its log lines are kept."""
    executor, fl_ctx, _ = site_executor(tmp_path, {"data": SITE_DATA, "policy": policy})
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: SimpleNamespace(trainer=SimpleNamespace()))
    monkeypatch.setattr(executor, "_dispatch", lambda *a: pytest.fail("the site trained"))
    logged: list[str] = []
    monkeypatch.setattr(executor, "log_error", lambda fl_ctx, message: logged.append(message))
    executor._get_runtime(fl_ctx)  # loads the site's copy of the plan
    return executor, fl_ctx, logged


def honest_proof(executor) -> dict:
    """What an honest server of the site's own plan sends."""
    plan = executor._plan
    return server_proof(plan.digest(), plan.defences, plan.min_clients, plan.secure_aggregation == "he")


def test_a_task_of_a_server_running_another_plan_is_declined_naming_both_fingerprints(tmp_path, monkeypatch) -> None:
    executor, fl_ctx, logged = executor_with_policy(tmp_path, monkeypatch, {})
    own = executor._plan.digest()
    proof = {**honest_proof(executor), contracts.SERVER_PLAN: "0123456789ab"}
    reply = executor.execute("train", proved_task(proof), fl_ctx, Signal())
    assert reply.get_header(contracts.DECLINED_HEADER) == "server_plan"
    assert "server_plan" in contracts.DECLINE_REASONS
    [line] = logged
    assert line.startswith("site-1: task 'train' declined: ") and "'0123456789ab'" in line and repr(own) in line


def test_a_task_without_proof_is_declined(tmp_path, monkeypatch) -> None:
    executor, fl_ctx, logged = executor_with_policy(tmp_path, monkeypatch, {})
    reply = executor.execute("validate", proved_task({}), fl_ctx, Signal())
    assert reply.get_header(contracts.DECLINED_HEADER) == "server_plan"
    assert "does not prove its plan" in logged[0]


def test_a_server_declaring_weaker_defences_than_the_policy_requires_is_declined(tmp_path, monkeypatch) -> None:
    """The fingerprint matches (a server that runs its aggregator without the plan's defences): the policy's own
    requirements judge the defences the server declares, not the site's copy of the plan."""
    executor, fl_ctx, logged = executor_with_policy(tmp_path, monkeypatch, {"require": ["robust"]})
    assert executor._plan.defences.max_norm_ratio > 0  # the site's copy has the defences: only the server lacks them
    proof = server_proof(executor._plan.digest(), RobustConfig(), 1, False)  # robust off, min_clients 1
    reply = executor.execute("train", proved_task(proof), fl_ctx, Signal())
    assert reply.get_header(contracts.DECLINED_HEADER) == "server_defences"
    [line] = logged
    assert "max_norm_ratio=0, max_share=0, min_clients=1" in line and "the job has no robust" in line


def test_declared_defences_that_do_not_read_are_declined(tmp_path, monkeypatch) -> None:
    executor, fl_ctx, logged = executor_with_policy(tmp_path, monkeypatch, {})
    proof = honest_proof(executor)
    proof[contracts.SERVER_DEFENCES] = {**proof[contracts.SERVER_DEFENCES], "min_clients": "1"}
    reply = executor.execute("train", proved_task(proof), fl_ctx, Signal())
    assert reply.get_header(contracts.DECLINED_HEADER) == "server_defences"
    assert "do not read" in logged[0]


def test_an_honest_server_is_answered_and_the_result_carries_the_sites_fingerprint(tmp_path, monkeypatch) -> None:
    executor, fl_ctx, logged = executor_with_policy(tmp_path, monkeypatch, {"require": ["robust"]})
    answer = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2, np.float32)}, meta={}).to_shareable()
    monkeypatch.setattr(executor, "_dispatch", lambda *a: answer)
    reply = executor.execute("train", proved_task(honest_proof(executor)), fl_ctx, Signal())
    assert logged == [] and reply is answer
    assert reply.get_header(contracts.SITE_PLAN_HEADER) == executor._plan.digest()


def test_every_task_the_controller_sends_proves_its_plan_and_defences() -> None:
    plan = site_data_plan(robust={"max_norm_ratio": 5.0, "max_share": 0.6})
    controller = MedflareController().use_plan(plan)
    controller.aggregator = SimpleNamespace(core=SimpleNamespace(robust=plan.defences), holds_plaintext=True)
    proof = controller._plan_proof()  # start_controller fixes it once the aggregator is there
    assert proof[contracts.SERVER_PLAN] == plan.digest()
    assert proof[contracts.SERVER_DEFENCES] == {
        "robust": {"max_norm_ratio": 5.0, "max_share": 0.6},
        "min_clients": plan.min_clients, "secure_aggregation": "off"}


@pytest.mark.parametrize("site_plan", ["0123456789ab", None])
def test_the_server_refuses_a_result_of_a_site_running_another_plan(site_plan) -> None:
    plan = site_data_plan()
    controller = MedflareController().use_plan(plan)
    controller.aggregator = SimpleNamespace(accept=lambda *a: pytest.fail("a result of another plan was aggregated"))
    warnings: list[str] = []
    controller.log_warning = lambda fl_ctx, message: warnings.append(message)
    result = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2, np.float32)}, meta={"n_samples": 10}).to_shareable()
    if site_plan:
        result.set_header(contracts.SITE_PLAN_HEADER, site_plan)
    record = run_results.new_record(0, time.time())
    task = SimpleNamespace(client=SimpleNamespace(name="site-2"), result=result)
    controller._on_result("train", task, record, {}, None)
    shown = repr(site_plan) if site_plan else "none"
    assert record["rejected"] == {"site-2": f"site-2 runs plan {shown}, the server runs plan {plan.digest()!r}"}
    assert warnings == [f"medflare: REFUSED the 'train' result of {record['rejected']['site-2']}"]
    assert controller.results.data["site_plans"] == {"site-2": site_plan}


def test_the_server_takes_a_result_of_its_own_plan_on_to_the_aggregator() -> None:
    plan = site_data_plan()
    controller = MedflareController().use_plan(plan)
    seen: list[str] = []
    controller.aggregator = SimpleNamespace(accept=lambda result, fl_ctx: seen.append("accept") or False)
    result = DXO(DataKind.WEIGHTS, data={}, meta={}).to_shareable()
    result.set_header(contracts.SITE_PLAN_HEADER, plan.digest())
    record = run_results.new_record(0, time.time())
    controller._on_result("train", SimpleNamespace(client=SimpleNamespace(name="site-1"), result=result), record, {},
                          None)
    assert seen == ["accept"] and record["rejected"] == {}
    assert controller.results.data["site_plans"] == {"site-1": plan.digest()}


@pytest.mark.parametrize("server_nvflare", ["2.7.1", None])
def test_a_task_of_a_server_on_a_flare_with_known_advisories_is_declined(tmp_path, monkeypatch,
                                                                        server_nvflare) -> None:
    """Issue 64: every task carries the server's FLARE release; one below 2.7.2, or none, is declined."""
    executor, fl_ctx, logged = executor_with_policy(tmp_path, monkeypatch, {})
    proof = honest_proof(executor)
    assert proof[contracts.SERVER_NVFLARE] == "2.9.0"  # what this server runs
    if server_nvflare is None:
        del proof[contracts.SERVER_NVFLARE]
    else:
        proof[contracts.SERVER_NVFLARE] = server_nvflare
    reply = executor.execute("train", proved_task(proof), fl_ctx, Signal())
    assert reply.get_header(contracts.DECLINED_HEADER) == "platform" and "platform" in contracts.DECLINE_REASONS
    [line] = logged
    assert "the server runs nvflare" in line and ("below 2.7.2" in line if server_nvflare else "'none'" in line)
