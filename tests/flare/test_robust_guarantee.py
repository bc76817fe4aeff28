"""Issue 60, item 2: a defence is a guarantee for this job's sites, or it is refused. A robust rule the job's sites
cannot hold is refused in one line at export and wherever a plan is read; a round with fewer answering sites than
its rule needs keeps the previous model and says why; a site's ``require: ["robust"]`` means concrete bounds (or a
rule that holds for the job's sites), also for the defences a server declares; the export says "robust aggregation:
on" only when that is so."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from medflare.console.cli import robust_note
from medflare.errors import ConfigError, PayloadError
from medflare.flare import run_results
from medflare.methods.base import RoundContext
from medflare.plan import read_plan, write_plan
from medflare.plan_proof import server_proof, task_refusal
from medflare.registry import get_method
from medflare.run_config import RunConfig
from medflare.server_round import RoundAggregation
from medflare.server_setup import DEPLOY_ROBUST, RobustConfig
from medflare.site_config import SiteFile
from medflare.site_policy import SitePolicy, site_policy

from .._plans import run_plan, site_data_plan
from ..test_cli import TASK, run_cli
from .test_aggregator import GLOBAL, update
from .test_controller_progress import started

UNBOUNDED = {"max_share": 1.0, "max_norm_ratio": 1e300}  # both "on", neither bounds anything
MEDIAN = {"rule": "median", "max_share": 0.45}


@pytest.mark.parametrize("clients, robust, needed", [
    (2, MEDIAN, 3),  # the median of two sites is their mean
    (3, {"rule": "trimmed_mean", "trim_fraction": 0.2, "max_share": 0.2}, 5),  # 3 x 0.2 < 1: the cap relaxes to 1/3
    (3, {"rule": "trimmed_mean", "trim_fraction": 0.3, "max_share": 0.3}, 4),  # 0.3 x 3 < 1: no whole site is cut
    (4, {"rule": "multi_krum", "hostile_sites": 2}, 5),  # n >= f + 3
])
def test_a_rule_the_jobs_sites_cannot_hold_is_refused_in_one_line_naming_the_sites(
    clients: int, robust: dict, needed: int
) -> None:
    with pytest.raises(ConfigError) as refused:
        run_plan(RunConfig(method="fedavg", clients=clients, min_clients=1, robust=robust))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"robust.rule={robust['rule']} with ")
    assert f"needs at least {needed} sites; the job has {clients}" in line
    run_plan(RunConfig(method="fedavg", clients=needed, min_clients=1, robust=robust))  # enough sites: accepted


def test_the_cli_export_refuses_a_median_of_two_sites(tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(["export", "fedavg", "--mode", "preinstalled", *TASK, "--set", "robust.rule=median",
                              "--set", "robust.max_share=0.45", "-o", str(tmp_path)], capsys)
    assert code != 0 and "Traceback" not in err
    assert "robust.rule=median with max_share=0.45" in err and "needs at least 3 sites; the job has 2" in err
    assert not (tmp_path / "fedavg").exists()


@pytest.mark.parametrize("rule", ["krum", "multi_krum", "bulyan"])
def test_a_krum_rule_assuming_no_hostile_site_is_refused(rule: str) -> None:
    """Multi-Krum with f = 0 kept every site and recorded ``tolerates_one_site: true``."""
    with pytest.raises(ConfigError, match=f"robust.rule={rule} with hostile_sites=0 assumes no hostile site"):
        RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=2,
                         robust={"rule": rule, "hostile_sites": 0})


def test_an_edited_plan_whose_rule_its_sites_cannot_hold_is_refused_where_it_is_read(tmp_path: Path) -> None:
    """The server's aggregator and every site read the job's plan at start: an edit to the median of two sites is
    refused there, before any round."""
    write_plan(site_data_plan(), tmp_path)
    path = tmp_path / "medflare_plan.json"
    record = json.loads(path.read_text())
    record["plan"]["robust"] = MEDIAN
    path.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="needs at least 3 sites; the job has 2"):
        read_plan(path)


def median_round(answering: dict[str, float], **robust) -> RoundAggregation:
    core = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=2, robust={**MEDIAN, **robust})
    core.start_round(GLOBAL, RoundContext(0, 2))
    core.start_phase("train")
    for site, value in answering.items():
        assert core.accept(site, *update(value)) is None
    return core


def test_a_median_round_with_two_answering_sites_keeps_the_previous_model_and_says_why() -> None:
    """One of three hospitals missing: the median of the other two was their mean, the hostile one's value half."""
    core = median_round({"site-1": 1.0, "site-2": 1e6})
    with pytest.raises(PayloadError) as failed:
        core.aggregate()
    message = str(failed.value)
    assert "robust.rule=median with max_share=0.45" in message and "needs at least 3 sites; 2 answered" in message
    assert "(site-1, site-2)" in message and "previous global model is kept" in message
    assert median_round({"site-1": 1.0, "site-2": 1.1, "site-3": 1e6}).aggregate().params["w"].max() <= 1.1


def test_a_round_the_norm_bound_leaves_below_the_rules_need_keeps_the_previous_model() -> None:
    core = median_round({"site-1": 1.0, "site-2": 1.1, "site-3": 1.05, "site-4": 1e30}, max_norm_ratio=10)
    core.robust = dataclasses.replace(core.robust, max_share=0.3)  # 4 sites meet it (1.2), the 3 left do not (0.9)
    with pytest.raises(PayloadError, match="needs at least 4 sites; 3 answered"):
        core.aggregate()
    assert "exceeds 10 x" in core.rejected["site-4"]


def test_the_controller_keeps_the_previous_model_of_a_round_below_the_rules_need(tmp_path: Path, monkeypatch) -> None:
    controller = started(False, tmp_path, monkeypatch, MEDIAN, clients=3)
    before = {key: value.copy() for key, value in controller.global_params.items()}
    core = controller.aggregator.core
    core.start_round(before, RoundContext(0, 2))
    core.start_phase("train")
    for site, value in (("site-1", 1.0), ("site-2", 1e6)):
        assert core.accept(site, {"w": np.full(2, value, np.float32)}, {"n_samples": 10}) is None
    errors: list[str] = []
    monkeypatch.setattr(controller, "fire_event", lambda *args: None)
    monkeypatch.setattr(controller, "log_error", lambda fl_ctx, message: errors.append(message))
    record = run_results.new_record(0, time.time())
    controller._aggregate(record, None)
    assert {key: value.tolist() for key, value in controller.global_params.items()} == \
        {key: value.tolist() for key, value in before.items()}
    assert "needs at least 3 sites; 2 answered" in record["aggregation_error"] and errors


@pytest.mark.parametrize("clients, robust, policy, accepted, words", [
    (2, UNBOUNDED, {}, False, "max_norm_ratio=1e+300 is above 10; max_share=1 lets one of 2 site(s) weigh 1"),
    (2, DEPLOY_ROBUST, {}, True, ""),
    (2, {"max_norm_ratio": 10.0, "max_share": 0.4}, {}, True, ""),  # the cap relaxes to 0.5 each: still <= 0.6
    (1, DEPLOY_ROBUST, {}, False, "lets one of 1 site(s) weigh 1"),
    (3, {**MEDIAN, "max_norm_ratio": 0.0}, {}, True, ""),  # a rule whose guarantee holds for three sites
    (2, DEPLOY_ROBUST, {"robust_max_share": 0.5}, False, "max_share=0.6 lets one of 2 site(s) weigh 0.6, above 0.5"),
    (2, {"max_norm_ratio": 15.0, "max_share": 0.6}, {"robust_max_norm_ratio": 20}, True, ""),
])
def test_require_robust_means_concrete_bounds_or_a_rule_that_holds_for_the_jobs_sites(
    clients: int, robust: dict, policy: dict, accepted: bool, words: str
) -> None:
    plan = site_data_plan(clients=clients, min_clients=1, robust=robust)
    refusal = SitePolicy(require=["robust"], **policy).refusal(plan)
    assert (refusal == "") is accepted
    assert refusal.startswith("the job has no robust, which this site requires") or accepted
    assert words in refusal


def test_a_sites_own_robust_bounds_are_range_checked(tmp_path: Path) -> None:
    (tmp_path / "medflare_site.json").write_text(json.dumps({"policy": {"robust_max_share": 1.5}}))
    with pytest.raises(ConfigError, match="robust_max_share must be"):
        site_policy(SiteFile.of(tmp_path))


def test_a_server_declaring_unbounded_defences_is_declined_by_a_site_requiring_robust() -> None:
    """The server's declared defences are judged by the same policy: max_share 1 with a 1e300 norm bound is on,
    and bounds nothing."""
    plan = site_data_plan(robust=DEPLOY_ROBUST)
    digest, policy = plan.digest(), SitePolicy(require=["robust"])
    assert task_refusal(plan, digest, policy, server_proof(digest, plan.defences, plan.min_clients, False)) is None
    refusal = task_refusal(plan, digest, policy, server_proof(digest, RobustConfig(**UNBOUNDED), 1, False))
    assert refusal is not None and refusal.reason == "server_defences"
    assert "max_norm_ratio=1e+300 is above 10" in refusal.detail


@pytest.mark.parametrize("clients, robust, on", [
    (2, UNBOUNDED, False), (2, DEPLOY_ROBUST, True), (3, MEDIAN, True), (2, {"max_share": 0.6}, False)])
def test_the_export_says_robust_aggregation_on_only_when_it_holds_for_the_jobs_sites(
    clients: int, robust: dict, on: bool
) -> None:
    note = robust_note(site_data_plan(clients=clients, min_clients=1, robust=robust))
    assert note.startswith("robust aggregation: on (") is on
    assert on or note.startswith(f"robust aggregation: no guarantee for this job's {clients} sites")


def test_the_cli_export_of_unbounded_defences_does_not_say_on(tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(["export", "fedavg", "--mode", "preinstalled", *TASK, "--set", "robust.max_share=1",
                              "--set", "robust.max_norm_ratio=1e300", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    assert "robust aggregation: on" not in out and "robust aggregation: no guarantee" in out
