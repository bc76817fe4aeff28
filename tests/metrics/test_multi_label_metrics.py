"""Multi-label statistics: summed over sites they give scikit-learn's per-class AUROC (within the stated bound),
macro F1, subset accuracy; unknown entries count nowhere; the wire form is validated against the task's kind."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score, roc_auc_score

from medflare.contracts import ContractContext, eval_stats_dict
from medflare.errors import DataError, PayloadError
from medflare.metrics import (
    EvalStats,
    MultiLabelEvalStats,
    binned_auc_error_bound,
    compute_metrics,
    stats_from_dict,
)

K = 5


def _site(n: int, seed: int, scale: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """Correlated multi-hot truth and sigmoid scores that carry some signal (``scale`` large = saturated)."""
    rng = np.random.default_rng(seed)
    labels = (rng.random((n, K)) < np.linspace(0.1, 0.5, K)).astype(np.int64)
    logits = scale * (rng.normal(size=(n, K)) + 1.5 * labels)
    return labels, 1.0 / (1.0 + np.exp(-logits))


@pytest.mark.parametrize("scale", [2.0, 6.0])
def test_two_sites_summed_equal_sklearn_per_class_auroc_within_the_bound(scale: float) -> None:
    """Per-class AUROC of the pooled statistics of two sites is sklearn's on the pooled scores, each class within
    binned_auc_error_bound (a few 1e-3 at most here, also for saturated scores at scale 6)."""
    (y1, p1), (y2, p2) = _site(400, 0, scale), (_site(300, 1, scale))
    pooled = MultiLabelEvalStats.from_predictions(y1, p1, K) + MultiLabelEvalStats.from_predictions(y2, p2, K)
    y, p = np.concatenate([y1, y2]), np.concatenate([p1, p2])

    metrics = compute_metrics(pooled)

    exact = [roc_auc_score(y[:, k], p[:, k]) for k in range(K)]
    bounds = [binned_auc_error_bound(pooled.pos_hist[k], pooled.neg_hist[k]) for k in range(K)]
    for k in range(K):
        assert abs(metrics["per_class_auc"][k] - exact[k]) <= bounds[k] + 1e-12
        assert bounds[k] < 3e-3
    assert abs(metrics["auc_macro_ovr"] - roc_auc_score(y, p, average="macro")) <= max(bounds) + 1e-12


def test_threshold_metrics_equal_sklearn_on_the_indicator_matrix() -> None:
    y, p = _site(500, 2)
    predicted = (p >= 0.5).astype(int)
    metrics = compute_metrics(MultiLabelEvalStats.from_predictions(y[:200], p[:200], K)
                              + MultiLabelEvalStats.from_predictions(y[200:], p[200:], K))
    scorers = (("macro_f1", f1_score), ("macro_precision", precision_score), ("macro_recall", recall_score))
    for name, function in scorers:
        assert metrics[name] == pytest.approx(function(y, predicted, average="macro", zero_division=0), abs=1e-12)
    assert metrics["accuracy"] == pytest.approx(accuracy_score(y, predicted), abs=1e-12)
    assert metrics["per_class_recall"] == pytest.approx(recall_score(y, predicted, average=None).tolist(), abs=1e-12)
    sensitivity = recall_score(y, predicted, average=None)
    specificity = recall_score(1 - y, 1 - predicted, average=None)
    assert metrics["balanced_accuracy"] == pytest.approx(float(np.mean((sensitivity + specificity) / 2)), abs=1e-12)


def test_unknown_entries_count_nowhere() -> None:
    """Masking entries to -1 gives each class the statistics of its known entries only; rows with no known entry
    are dropped; subset accuracy looks at known entries."""
    y, p = _site(300, 3)
    rng = np.random.default_rng(4)
    partial = np.where(rng.random(y.shape) < 0.3, -1, y)
    partial[:10] = -1  # ten rows nobody annotated
    stats = MultiLabelEvalStats.from_predictions(partial, p, K)
    metrics = compute_metrics(stats)

    assert stats.count == 290
    for k in range(K):
        known = partial[:, k] >= 0
        assert stats.confusion[k].sum() == known.sum()
        assert metrics["per_class_auc"][k] == pytest.approx(roc_auc_score(y[known, k], p[known, k]), abs=1e-3)
    right = ((p >= 0.5) == partial) | (partial < 0)
    assert stats.exact == int(right[10:].all(axis=1).sum())


def test_wire_form_round_trips_and_is_checked_against_the_task_kind() -> None:
    y, p = _site(50, 5)
    stats = MultiLabelEvalStats.from_predictions(y, p, K, loss_sum=12.5)
    wire = stats.to_dict()
    rebuilt = stats_from_dict(wire, K, multi_label=True)
    assert rebuilt.to_dict() == wire and rebuilt.exact == stats.exact

    check = eval_stats_dict("eval_test")
    assert check(wire, ContractContext(K, multi_label=True)) == wire
    with pytest.raises(PayloadError, match="2-D array"):  # multi-label statistics in a single-label job
        check(wire, ContractContext(K))
    single = EvalStats.from_predictions(np.zeros(3, int), np.full((3, K), 1 / K), K).to_dict()
    with pytest.raises(PayloadError, match="lacks"):  # single-label statistics in a multi-label job
        check(single, ContractContext(K, multi_label=True))
    with pytest.raises(PayloadError, match="undeclared entries"):
        check({**wire, "leak": [1, 2]}, ContractContext(K, multi_label=True))


@pytest.mark.parametrize("tamper, message", [
    (lambda d: d.update(exact=d["count"] + 1), "more known entries, or exact matches"),
    (lambda d: d["pos_hist"][0].__setitem__(0, d["pos_hist"][0][0] + 1), "known positives"),
    (lambda d: d.update(confusion=[[1, 2], [3, 4]]), "3-D array"),
    (lambda d: d.update(count=-1), "integer >= 0"),
    (lambda d: d.update(loss_sum=float("nan")), "finite number"),
])
def test_inconsistent_statistics_are_refused(tamper, message: str) -> None:
    y, p = _site(40, 6)
    wire = MultiLabelEvalStats.from_predictions(y, p, K).to_dict()
    tamper(wire)
    with pytest.raises(PayloadError, match=message):
        MultiLabelEvalStats.from_dict(wire, num_classes=K)


def test_predictions_must_be_sigmoid_scores_of_multi_hot_rows() -> None:
    y, p = _site(10, 7)
    with pytest.raises(DataError, match="sigmoid outputs, not logits"):
        MultiLabelEvalStats.from_predictions(y, p * 3, K)
    with pytest.raises(DataError, match="1, 0 or -1"):
        MultiLabelEvalStats.from_predictions(y * 2, p, K)
    assert (MultiLabelEvalStats.zeros(K) + MultiLabelEvalStats.from_predictions(y, p, K)).count == 10
