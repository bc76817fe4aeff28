"""FCA's generalization / specialization figures from a final evaluation block."""

from __future__ import annotations

import pytest

from medflare.evaluation import (
    SPECIALIZATION,
    headline_metric,
    metric_name,
    personalization_figures,
    selection_metric,
)

FINAL = {
    "test": {"balanced_accuracy": 0.6, "bauc": 0.8},
    "by_site": {"a": {"balanced_accuracy": 0.5, "bauc": 0.7}, "b": {"balanced_accuracy": 0.3, "bauc": 0.9}},
    "site_mean": {"balanced_accuracy": 0.4, "bauc": 0.8},
    "extra": {SPECIALIZATION: {
        "test": {"balanced_accuracy": 0.1},
        "by_site": {"a": {"balanced_accuracy": 0.9, "bauc": 0.95}, "b": {"balanced_accuracy": 0.7, "bauc": 0.85}},
        "site_mean": {"balanced_accuracy": 0.8, "bauc": 0.9},
    }},
}


def test_personal_models_give_the_specialization_and_the_global_model_the_generalization() -> None:
    figures = personalization_figures(FINAL, global_classifier=True, specialization=SPECIALIZATION)
    assert figures["generalization_bacc"] == 0.6 and figures["generalization_bauc"] == 0.8
    assert figures["specialization_bacc"] == 0.8 and figures["specialization_bauc"] == 0.9
    assert figures["gs_mean_bacc"] == pytest.approx(0.7) and figures["gs_mean_bauc"] == pytest.approx(0.85)
    assert figures["specialization_by_site"] == {"a": {"bacc": 0.9, "bauc": 0.95}, "b": {"bacc": 0.7, "bauc": 0.85}}


def test_a_single_model_method_is_specialized_by_the_global_model_per_site() -> None:
    figures = personalization_figures(FINAL, global_classifier=True, specialization=None)
    assert figures["specialization_bacc"] == 0.4 and figures["gs_mean_bacc"] == pytest.approx(0.5)
    assert figures["specialization_by_site"]["b"] == {"bacc": 0.3, "bauc": 0.9}


def test_without_a_global_classifier_there_is_no_generalization() -> None:
    figures = personalization_figures(FINAL, global_classifier=False, specialization=SPECIALIZATION)
    assert figures["generalization_bacc"] is None and figures["gs_mean_bauc"] is None
    assert figures["specialization_bacc"] == 0.8


def test_a_run_without_scores_gives_none_not_an_error() -> None:
    figures = personalization_figures({}, global_classifier=True)
    assert figures["generalization_bacc"] is None and figures["specialization_bauc"] is None
    assert figures["specialization_by_site"] == {}


def test_the_per_round_history_keeps_confusion_loss_and_count_but_not_the_score_histograms() -> None:
    import numpy as np

    from medflare.evaluation import HISTOGRAM_KEYS, summarize, without_histograms
    from medflare.methods.base import eval_stats

    labels = np.array([0, 1, 2, 1])
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4], [0.6, 0.3, 0.1]])
    stats = eval_stats(labels, probs, np.ones(4), num_classes=3)
    summary = summarize({"site-1": {"val": stats, "test": stats}})
    compact = without_histograms(summary)
    for split in ("val", "test"):
        assert set(compact[f"{split}_stats"]) == {"confusion", "loss_sum", "count"}
        assert compact[f"{split}_stats"]["confusion"] == summary[f"{split}_stats"]["confusion"]
        assert compact[split] == summary[split]  # the metrics computed from the histograms stay
        assert set(HISTOGRAM_KEYS) <= set(summary[f"{split}_stats"])  # the full summary ("final") is untouched
    assert np.asarray(summary["test_stats"]["pos_hist"]).size == 3 * 1000


def test_the_headline_metric_follows_the_task_and_the_recorded_selection() -> None:
    assert (headline_metric(multi_label=False), headline_metric(multi_label=True)) == ("balanced_accuracy",
                                                                                       "auc_macro_ovr")
    assert selection_metric({"key_metric": "auc_macro_ovr", "best": {}}) == "auc_macro_ovr"
    assert selection_metric({"best": {"model_version": 3, "auc_macro_ovr": 0.7}}) == "auc_macro_ovr"  # earlier files
    assert selection_metric({}, multi_label=True) == "auc_macro_ovr" and selection_metric({}) == "balanced_accuracy"
    assert metric_name("auc_macro_ovr") == "macro AUROC" and metric_name("macro_f1") == "macro f1"
