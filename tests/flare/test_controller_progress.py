"""The controller's early-stopping decision and the progress it serves through FLARE's show_stats, without FLARE's
runtime (the simulator and POC tests run both for real)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.widgets.info_collector import GroupInfoCollector, InfoCollector

from medflare.evaluation import metric_name
from medflare.flare.controller import MedflareController
from medflare.flare.progress import STATS_GROUP, entries_from_results, format_progress
from medflare.methods.base import RoundContext

from .._plans import site_data_plan


def controller_with_best(patience: int, best_version: int) -> MedflareController:
    controller = MedflareController().use_plan(site_data_plan(rounds=10, patience=patience))
    controller.results.data = {"rounds": [], "evaluations": {},
                           "best": {"model_version": best_version, "balanced_accuracy": 0.625}}
    return controller


@pytest.mark.parametrize("patience,best,round_index,stops", [
    (2, 0, 1, False),  # model 1 is the first without improvement
    (2, 0, 2, True),  # models 1 and 2 brought none: stop after round 3
    (2, 1, 2, False),
    (0, 0, 9, False),  # patience 0: never
])
def test_stops_after_patience_scored_rounds_without_improvement(patience, best, round_index, stops) -> None:
    controller = controller_with_best(patience, best)
    assert controller._stopping_early(RoundContext(round_index, 10), FLContext()) is stops
    stopped = controller.results.data.get("stopped_early")
    assert (stopped is not None) is stops
    if stops:
        assert stopped["after_round"] == round_index + 1 and stopped["best_model_version"] == best
        assert "did not improve for 2 rounds" in stopped["reason"] and "0.6250" in stopped["reason"]
        assert controller._progress[-1]["kind"] == "stopped"


def test_an_unscored_round_never_stops_the_job() -> None:
    controller = controller_with_best(1, 0)
    assert not controller._stopping_early(RoundContext(5, 10, stage="pretrain", scored=False), FLContext())


def test_show_stats_carries_the_progress_entries() -> None:
    controller = MedflareController().use_plan(site_data_plan(rounds=3))
    controller._track({"kind": "round", "round": 1, "rounds": 3, "seconds": 1.5, "accepted": ["site-1"],
                        "rejected": []}, FLContext())
    fl_ctx = FLContext()
    fl_ctx.set_prop(InfoCollector.CTX_KEY_STATS_COLLECTOR, GroupInfoCollector(), private=True, sticky=False)
    controller.handle_event(InfoCollector.EVENT_TYPE_GET_STATS, fl_ctx)
    info = fl_ctx.get_prop(InfoCollector.CTX_KEY_STATS_COLLECTOR).info[STATS_GROUP]
    assert info["num_rounds"] == 3
    assert [format_progress(e) for e in info["progress"]] == ["round 1/3 done in 1.5s; accepted ['site-1']"]


def test_progress_rebuilt_from_results_reads_like_the_live_log() -> None:
    evaluation = {"sites": ["site-1", "site-2"], "test": {"balanced_accuracy": 0.5}, "val": {"balanced_accuracy": 0.4}}
    results = {
        "num_rounds": 4,
        "rounds": [{"round": 0, "wall_seconds": 2.0, "share": {"site-2": 0.5, "site-1": 0.5}, "rejected": {}},
                   {"round": 1, "wall_seconds": 1.0, "share": {"site-1": 1.0}, "rejected": {"site-2": "NaN"}}],
        "evaluations": {"0": evaluation, "1": evaluation},
        "stopped_early": {"after_round": 2, "reason": "val balanced_accuracy did not improve"},
        "final": {"model_version": 2, **evaluation},
        "best": {"model_version": 0, "balanced_accuracy": 0.4},
    }
    assert [format_progress(e) for e in entries_from_results(results)] == [
        "model 0 test balanced accuracy 0.5000, val 0.4000 (2 sites)",
        "round 1/4 done in 2.0s; accepted ['site-1', 'site-2']",
        "model 1 test balanced accuracy 0.5000, val 0.4000 (2 sites)",
        "round 2/4 done in 1.0s; accepted ['site-1'], rejected ['site-2']",
        "stopping early after round 2: val balanced_accuracy did not improve",
        "model 2 test balanced accuracy 0.5000, val 0.4000 (2 sites)",
    ]


MULTI_LABEL_EVALUATION = {"sites": ["site-1", "site-2"], "test": {"balanced_accuracy": 0.5, "auc_macro_ovr": 0.7123},
                          "val": {"balanced_accuracy": 0.5, "auc_macro_ovr": 0.701}}


def test_a_multi_label_run_reports_the_auroc_it_is_selected_by() -> None:
    """Its balanced accuracy at the 0.5 threshold sat at 0.5000 every round; AUROC is what picks its best model."""
    results = {"num_rounds": 2, "key_metric": "auc_macro_ovr", "rounds": [],
               "final": {"model_version": 2, **MULTI_LABEL_EVALUATION}}
    assert [format_progress(e) for e in entries_from_results(results)] == [
        "model 2 test macro AUROC 0.7123, val 0.7010 (2 sites)"]


def test_watch_still_reads_the_entries_of_an_earlier_server() -> None:
    earlier = {"kind": "evaluation", "model": 1, "sites": 2, "test_balanced_accuracy": 0.5,
               "val": {"balanced_accuracy": 0.4}}
    assert format_progress(earlier) == "model 1 test balanced accuracy 0.5000, val 0.4000 (2 sites)"


def started(multi_label: bool, tmp_path: Path, monkeypatch, robust: dict | None = None,
            clients: int = 2) -> MedflareController:
    """A controller after FLARE's ``start_controller``, its engine stubbed: a MedflareAggregator of this task."""
    from medflare.flare import controller as controller_module
    from medflare.flare.aggregator import MedflareAggregator

    monkeypatch.setattr(controller_module, "freeze_startup_objects", lambda: None)  # no gc.freeze in the test run
    plan = site_data_plan("fedavg", 3, rounds=2, multi_label=multi_label, clients=clients, robust=robust or {})
    aggregator = MedflareAggregator().use_plan(plan)
    persistor = SimpleNamespace(load=lambda fl_ctx: {ModelLearnableKey.WEIGHTS: {"w": np.zeros(2, np.float32)}})
    controller = MedflareController().use_plan(plan)
    controller._engine = SimpleNamespace(get_component={"aggregator": aggregator, "persistor": persistor}.get)
    fl_ctx = FLContext()
    fl_ctx.set_prop(FLContextKey.APP_ROOT, str(tmp_path), private=True, sticky=False)
    controller.start_controller(fl_ctx)
    return controller


@pytest.mark.parametrize("multi_label,metric,other", [(False, "balanced_accuracy", "auc_macro_ovr"),
                                                      (True, "auc_macro_ovr", "balanced_accuracy")])
def test_the_best_model_is_selected_by_the_tasks_headline_metric(multi_label, metric, other, tmp_path: Path,
                                                                  monkeypatch) -> None:
    from medflare.flare import controller as controller_module

    controller = started(multi_label, tmp_path, monkeypatch)
    assert controller.results.key_metric == metric
    assert controller.results.data["key_metric"] == metric  # report reads it back
    scores = iter([(0.6, 0.9), (0.8, 0.5), (0.7, 0.95)])  # (headline, the other metric) of models 0, 1, 2

    def summarize(evaluations: dict, shot_groups: dict | None, share_cap: float = 0.0) -> dict:  # the sites' pooled scores of each model
        headline, rest = next(scores)
        return {"sites": ["site-1"], "test": {metric: headline, other: rest}, "val": {metric: headline, other: rest}}

    monkeypatch.setattr(controller_module, "summarize", summarize)
    monkeypatch.setattr(controller_module, "send_scalars", lambda *args, **kwargs: None)
    monkeypatch.setattr(controller, "fire_event", lambda *args: None)
    lines = []
    monkeypatch.setattr(controller, "log_info", lambda fl_ctx, line: lines.append(line))
    for version in range(3):
        controller._record_evaluation(version, {}, FLContext())
    assert controller.results.data["best"] == {"model_version": 1, metric: 0.8}
    assert lines[1] == f"medflare: model 1 test {metric_name(metric)} 0.8000, val 0.8000 (1 sites)"


def test_the_best_model_saved_after_the_next_task_is_out_is_the_scored_one(tmp_path: Path, monkeypatch) -> None:
    """The best model's write waits for the round's housekeeping (off the critical path), by which time the
    context holds the next round's model: the persistor must still get the model that was scored."""
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.app_event_type import AppEventType

    from medflare.flare import controller as controller_module

    controller = started(False, tmp_path, monkeypatch)
    monkeypatch.setattr(controller_module, "summarize", lambda evaluations, shot_groups, share_cap=0.0: {
        "sites": ["site-1"], "val": {"balanced_accuracy": 0.7}, "test": {"balanced_accuracy": 0.7}})
    monkeypatch.setattr(controller_module, "send_scalars", lambda *args, **kwargs: None)
    saved = []

    def fire_event(event: str, fl_ctx: FLContext) -> None:
        if event == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE:  # what FLARE's persistor reads and writes
            saved.append(fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)[ModelLearnableKey.WEIGHTS]["w"].copy())

    monkeypatch.setattr(controller, "fire_event", fire_event)
    fl_ctx = FLContext()
    scored = {"w": np.array([1.0, 2.0], np.float32)}
    controller.global_params = scored
    controller._record_evaluation(0, {}, fl_ctx)
    assert saved == []  # not while the round still holds up the next one
    controller.global_params = {"w": np.array([9.0, 9.0], np.float32)}  # aggregated; the next task carries it
    fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, {ModelLearnableKey.WEIGHTS: controller.global_params}, private=True,
                    sticky=True)
    controller._close_round({"server_seconds": {}}, fl_ctx)
    assert len(saved) == 1 and saved[0].tolist() == [1.0, 2.0]
    assert fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)[ModelLearnableKey.WEIGHTS]["w"].tolist() == [9.0, 9.0]
    controller._close_round({"server_seconds": {}}, fl_ctx)
    assert len(saved) == 1  # saved once


def test_a_declining_sites_reason_is_recorded_only_from_the_closed_vocabulary() -> None:
    """Issue 49, item 5: no free text a site writes reaches the server's record."""
    from medflare.flare.controller import declined_text

    assert declined_text("EXECUTION_EXCEPTION", "dp_budget") == ("EXECUTION_EXCEPTION: declined: its DP-SGD budget "
                                                                 "is spent; it stops contributing")
    assert declined_text("EXECUTION_EXCEPTION", "/data/patients/jane-doe.png") == (
        "EXECUTION_EXCEPTION: declined (an unrecognised reason, not recorded)")
    assert declined_text("EXECUTION_EXCEPTION", None) == "EXECUTION_EXCEPTION"


@pytest.mark.parametrize("robust, record", [
    ({"max_norm_ratio": 10.0, "max_share": 0.6}, {"on": True, "max_norm_ratio": 10.0, "max_share": 0.6}),
    ({}, {"on": False, "max_norm_ratio": 0.0, "max_share": 0.0}),  # edited out of an exported job's config
])
def test_the_results_record_the_defences_the_server_ran_with(robust: dict, record: dict, tmp_path: Path,
                                                               monkeypatch) -> None:
    """Issue 49, item 5: the server's record comes from its own aggregator, not from what meta.json says."""
    assert started(False, tmp_path, monkeypatch, robust).results.data["robust_aggregation"] == record


@pytest.mark.parametrize("nvflare, panics, warns", [("2.7.1", True, False), ("2.9.1", False, True),
                                                    ("2.9.0", False, False)])
def test_the_server_refuses_to_start_on_a_flare_with_known_advisories_and_warns_on_another_release(
        tmp_path: Path, monkeypatch, nvflare: str, panics: bool, warns: bool) -> None:
    """Issue 64: the controller checks the FLARE it runs on when the job starts (the plan was resolved on 2.9.0)."""

    panicked, warned = [], []
    monkeypatch.setattr("medflare.advisories.installed_nvflare", lambda: nvflare)
    monkeypatch.setattr(MedflareController, "system_panic", lambda self, reason, fl_ctx: panicked.append(reason))
    monkeypatch.setattr(MedflareController, "log_warning", lambda self, fl_ctx, message: warned.append(message))
    controller = started(False, tmp_path, monkeypatch)
    assert bool(panicked) == panics and bool(warned) == warns
    if panics:
        assert "the server runs nvflare 2.7.1, below 2.7.2" in panicked[0] and "CVE-2026-24204" in panicked[0]
        assert not hasattr(controller, "global_params")  # nothing of the job was started
    if warns:
        assert warned == ["medflare: the server runs nvflare 2.9.1, the job was exported with 2.9.0; medflare was "
                          "tested with the job's"]
