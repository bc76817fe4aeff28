"""The controller's early-stopping decision and the progress it serves through FLARE's show_stats, without FLARE's
runtime (the simulator and POC tests run both for real)."""

from __future__ import annotations

import pytest
from nvflare.apis.fl_context import FLContext
from nvflare.widgets.info_collector import GroupInfoCollector, InfoCollector

from medflare.flare.controller import MedflareController
from medflare.flare.progress import STATS_GROUP, entries_from_results, format_progress
from medflare.methods.base import RoundContext


def controller_with_best(patience: int, best_version: int) -> MedflareController:
    controller = MedflareController(num_rounds=10, patience=patience)
    controller._results = {"rounds": [], "evaluations": {},
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
    stopped = controller._results.get("stopped_early")
    assert (stopped is not None) is stops
    if stops:
        assert stopped["after_round"] == round_index + 1 and stopped["best_model_version"] == best
        assert "did not improve for 2 rounds" in stopped["reason"] and "0.6250" in stopped["reason"]
        assert controller._progress[-1]["kind"] == "stopped"


def test_an_unscored_round_never_stops_the_job() -> None:
    controller = controller_with_best(1, 0)
    assert not controller._stopping_early(RoundContext(5, 10, stage="pretrain", scored=False), FLContext())


def test_show_stats_carries_the_progress_entries() -> None:
    controller = MedflareController(num_rounds=3)
    controller._report({"kind": "round", "round": 1, "rounds": 3, "seconds": 1.5, "accepted": ["site-1"],
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
        "model 0 test balanced accuracy 0.5000 (2 sites)",
        "round 1/4 done in 2.0s; accepted ['site-1', 'site-2']",
        "model 1 test balanced accuracy 0.5000 (2 sites)",
        "round 2/4 done in 1.0s; accepted ['site-1'], rejected ['site-2']",
        "stopping early after round 2: val balanced_accuracy did not improve",
        "model 2 test balanced accuracy 0.5000 (2 sites)",
    ]
