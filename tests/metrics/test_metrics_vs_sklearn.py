"""compute_metrics on summed statistics equals scikit-learn on the pooled predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import (
    accuracy_score,
    auc,
    balanced_accuracy_score,
    f1_score,
    precision_score,
    recall_score,
    roc_auc_score,
    roc_curve,
)

from medflare.errors import ConfigError
from medflare.metrics import EvalStats, binned_auc_error_bound, compute_metrics, shot_groups_from_counts

AUC_TOLERANCE = 1e-3


def _random_predictions(num_classes: int, n: int, seed: int, classes_in_truth=None):
    rng = np.random.default_rng(seed)
    y_true = rng.choice(classes_in_truth if classes_in_truth is not None else num_classes, size=n)
    logits = rng.normal(size=(n, num_classes)) + 1.2 * np.eye(num_classes)[y_true]
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return y_true, probs


def _fca_bauc(y_true: np.ndarray, probs: np.ndarray) -> float:
    """FCA's helper.py::test computation on exact scores."""
    grid = np.linspace(0.0, 1.0, 1000)
    present = np.unique(y_true)
    per_class = []
    for k in present:
        fpr, tpr, _ = roc_curve(y_true == k, probs[:, k])
        per_class.append(auc(grid, np.interp(grid, fpr, tpr)))
    return float(np.mean(per_class))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_classes", [2, 5])
def test_matches_sklearn(num_classes: int, seed: int) -> None:
    y_true, probs = _random_predictions(num_classes, 500, seed)
    y_pred = probs.argmax(axis=1)
    metrics = compute_metrics(EvalStats.from_predictions(y_true, probs, num_classes))

    assert metrics["accuracy"] == pytest.approx(accuracy_score(y_true, y_pred), abs=1e-12)
    assert metrics["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y_true, y_pred), abs=1e-12)
    assert metrics["macro_f1"] == pytest.approx(f1_score(y_true, y_pred, average="macro"), abs=1e-12)
    assert metrics["macro_precision"] == pytest.approx(precision_score(y_true, y_pred, average="macro"), abs=1e-12)
    assert metrics["macro_recall"] == pytest.approx(recall_score(y_true, y_pred, average="macro"), abs=1e-12)
    expected_auc = (
        roc_auc_score(y_true, probs[:, 1])
        if num_classes == 2
        else roc_auc_score(y_true, probs, multi_class="ovr", average="macro")
    )
    assert metrics["auc_macro_ovr"] == pytest.approx(expected_auc, abs=AUC_TOLERANCE)
    assert metrics["bauc"] == pytest.approx(_fca_bauc(y_true, probs), abs=AUC_TOLERANCE)
    per_class_auc = [roc_auc_score(y_true == k, probs[:, k]) for k in range(num_classes)]
    np.testing.assert_allclose(metrics["per_class_auc"], per_class_auc, atol=AUC_TOLERANCE)


def _confident_predictions(scale: float, n: int = 3000, seed: int = 0):
    """A long-tailed 5-class set scored by an over-confident model: float32 softmax of scaled logits."""
    rng = np.random.default_rng(seed)
    y_true = rng.choice(5, size=n, p=[0.5, 0.25, 0.12, 0.08, 0.05])
    logits = scale * (0.6 * rng.normal(size=(n, 5)) + np.eye(5)[y_true])
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float32), dim=1).double().numpy()
    return y_true, probs


@pytest.mark.parametrize("scale", [5.0, 10.0, 25.0, 60.0])
def test_auc_of_saturated_softmax_outputs_matches_sklearn(scale: float) -> None:
    # At scale 10 most scores are below 1e-3 or above 0.999; equal-width bins on p were 0.014 too low there.
    y_true, probs = _confident_predictions(scale)
    assert np.mean((probs < 1e-3) | (probs > 0.999)) > (0.5 if scale >= 10 else 0.2)
    stats = EvalStats.from_predictions(y_true, probs, 5)
    metrics = compute_metrics(stats)
    exact = [roc_auc_score(y_true == k, probs[:, k]) for k in range(5)]
    for k in range(5):
        gap = abs(metrics["per_class_auc"][k] - exact[k])
        assert gap <= binned_auc_error_bound(stats.pos_hist[k], stats.neg_hist[k]) + 1e-12
        assert gap < AUC_TOLERANCE, f"class {k}"
    expected = roc_auc_score(y_true, probs, multi_class="ovr", average="macro")
    assert metrics["auc_macro_ovr"] == pytest.approx(expected, abs=AUC_TOLERANCE / 4)


def test_error_bound_counts_only_pairs_sharing_a_bin() -> None:
    # 2 positives (bins 1, 2), 2 negatives (bins 0, 2): one of the 4 pairs shares bin 2 -> bound 0.5 * 1 / 4
    assert binned_auc_error_bound(np.array([0, 1, 1]), np.array([1, 0, 1])) == pytest.approx(0.125)
    assert np.isnan(binned_auc_error_bound(np.array([0, 0]), np.array([1, 0])))


@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
def test_classes_missing_from_truth_and_predictions_follow_sklearn() -> None:
    num_classes = 5
    y_true, probs = _random_predictions(num_classes, 300, seed=3, classes_in_truth=[0, 1, 3])
    probs[:, 4] = 0.0  # class 4 is never predicted nor true; class 2 is predicted but never true
    probs /= probs.sum(axis=1, keepdims=True)
    y_pred = probs.argmax(axis=1)
    assert 2 in y_pred and 2 not in y_true
    metrics = compute_metrics(EvalStats.from_predictions(y_true, probs, num_classes))

    assert metrics["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y_true, y_pred))
    assert metrics["macro_f1"] == pytest.approx(f1_score(y_true, y_pred, average="macro", zero_division=0))
    assert metrics["per_class_recall"][2] is None and metrics["per_class_recall"][4] is None
    present_auc = [roc_auc_score(y_true == k, probs[:, k]) for k in (0, 1, 3)]
    assert metrics["auc_macro_ovr"] == pytest.approx(np.mean(present_auc), abs=AUC_TOLERANCE)
    assert metrics["per_class_auc"][2] is None


def test_loss_is_mean_and_empty_set_is_undefined() -> None:
    y_true, probs = _random_predictions(3, 10, seed=4)
    assert compute_metrics(EvalStats.from_predictions(y_true, probs, 3, loss_sum=5.0))["loss"] == pytest.approx(0.5)
    empty = compute_metrics(EvalStats.from_predictions(np.zeros(0, dtype=int), np.zeros((0, 3)), 3))
    assert empty["accuracy"] is None and empty["balanced_accuracy"] is None and empty["auc_macro_ovr"] is None
    assert empty["loss"] is None and empty["per_class_recall"] == [None, None, None]


# ----- head / medium / tail ----------------------------------------------------------------------------------------
def test_shot_groups_thresholds() -> None:
    groups = shot_groups_from_counts([701, 700, 70, 69, 5000, 0], head_min=700, tail_max=70)
    assert groups == {"head": [0, 4], "medium": [1, 2], "tail": [3, 5]}
    with pytest.raises(ConfigError):
        shot_groups_from_counts([1, 2], head_min=10, tail_max=50)


def test_head_medium_tail_by_hand() -> None:
    # Train counts put class 0 in head, classes 1-2 in medium, class 3 in tail (700 / 70 thresholds).
    groups = shot_groups_from_counts([1000, 500, 80, 10], head_min=700, tail_max=70)
    confusion = np.array(
        [
            [4, 0, 0, 0],  # recall 1.0
            [1, 1, 0, 0],  # recall 0.5
            [3, 0, 1, 0],  # recall 0.25
            [2, 0, 0, 0],  # recall 0.0
        ]
    )
    y_true = np.repeat(np.arange(4), confusion.sum(axis=1))
    y_pred = np.concatenate([np.repeat(np.arange(4), row) for row in confusion])
    probs = np.eye(4)[y_pred]
    metrics = compute_metrics(EvalStats.from_predictions(y_true, probs, 4), shot_groups=groups)
    assert metrics["head_accuracy"] == pytest.approx(1.0)
    assert metrics["medium_accuracy"] == pytest.approx((0.5 + 0.25) / 2)
    assert metrics["tail_accuracy"] == pytest.approx(0.0)
    assert metrics["hmt_mean"] == pytest.approx((1.0 + 0.375 + 0.0) / 3)


def test_empty_group_leaves_hmt_mean_undefined() -> None:
    y_true, probs = _random_predictions(3, 30, seed=5)
    metrics = compute_metrics(
        EvalStats.from_predictions(y_true, probs, 3), shot_groups={"head": [0], "medium": [1, 2], "tail": []}
    )
    assert metrics["tail_accuracy"] is None and metrics["hmt_mean"] is None
    with pytest.raises(ConfigError):
        compute_metrics(EvalStats.from_predictions(y_true, probs, 3), shot_groups={"head": [3]})
