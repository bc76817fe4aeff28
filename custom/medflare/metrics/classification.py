"""Pooled classification metrics computed from summed :class:`EvalStats`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from medflare.errors import ConfigError
from medflare.metrics.eval_stats import EvalStats
from medflare.metrics.multi_label import MultiLabelEvalStats
from medflare.metrics.roc import binned_auc, interpolated_auc

__all__ = ["compute_metrics", "multi_label_metrics", "shot_groups_from_counts", "stats_from_dict"]

MetricValue = float | list[float | None] | None


def stats_from_dict(
    data: object, num_classes: int | None = None, multi_label: bool = False
) -> EvalStats | MultiLabelEvalStats:
    """Validated statistics of the job's kind: a multi-label job accepts only multi-label statistics and back."""
    return (MultiLabelEvalStats if multi_label else EvalStats).from_dict(data, num_classes=num_classes)


def compute_metrics(
    stats: EvalStats | MultiLabelEvalStats, shot_groups: Mapping[str, Sequence[int]] | None = None
) -> dict[str, MetricValue]:
    """Metrics of the pooled predictions summarised by ``stats`` (multi-label: :func:`multi_label_metrics`); an
    undefined value is None, not NaN, so it serialises to JSON. As sklearn computes them:

    * ``balanced_accuracy``: mean recall over the classes present in y_true.
    * ``macro_f1``/``_precision``/``_recall``: means over the classes present in y_true or the predictions, 0 for
      an undefined ratio (``average="macro"``).
    * ``auc_macro_ovr``: mean one-vs-rest ROC AUC over classes with positives and negatives, from the histograms
      (up to :func:`~medflare.metrics.roc.binned_auc_error_bound` per class); ``bauc``: FCA's, on a 1000-point
      FPR grid; ``per_class_recall``/``_auc`` (None where undefined); ``loss``: ``loss_sum / count``.
    * With ``shot_groups`` (ConfigError for a class outside [0, K)): ``<group>_accuracy``, the mean recall over the
      group's classes present in the test set (spec §1.5), and ``hmt_mean``, their plain mean (Fed-MAS's "All").
    """
    if isinstance(stats, MultiLabelEvalStats):
        return multi_label_metrics(stats)
    confusion = stats.confusion.astype(np.float64)
    true_counts, predicted_counts, hits = confusion.sum(axis=1), confusion.sum(axis=0), np.diag(confusion)
    present = true_counts > 0
    labelled_or_predicted = present | (predicted_counts > 0)

    recall = _ratio(hits, true_counts)
    f1 = _ratio(2 * hits, true_counts + predicted_counts)[labelled_or_predicted]
    metrics = _metric_table(stats, hits.sum(), recall[present], f1, _ratio(hits, predicted_counts)[labelled_or_predicted],
                            recall[labelled_or_predicted], recall)
    if shot_groups is not None:
        metrics.update(_group_accuracies(recall, shot_groups))
    return metrics


def multi_label_metrics(stats: MultiLabelEvalStats) -> dict[str, MetricValue]:
    """Metrics of pooled multi-label predictions (threshold 0.5), each class its own binary task: the keys of
    :func:`compute_metrics`, with ``auc_macro_ovr`` FedLSM's "Average AUC", macro means over all K classes,
    ``accuracy`` the subset accuracy (every known entry right), ``balanced_accuracy`` the mean over classes with
    known positives and negatives of ½(sensitivity + specificity) and ``loss`` the mean BCE."""
    hits = stats.confusion[:, 1, 1].astype(np.float64)
    positives = stats.confusion[:, 1].sum(axis=1).astype(np.float64)
    negatives = stats.confusion[:, 0].sum(axis=1).astype(np.float64)
    predicted = stats.confusion[:, :, 1].sum(axis=1).astype(np.float64)
    recall = _ratio(hits, positives)
    specificity = _ratio(stats.confusion[:, 0, 0].astype(np.float64), negatives)
    both = (positives > 0) & (negatives > 0)
    return _metric_table(stats, stats.exact, 0.5 * (recall[both] + specificity[both]),
                         _ratio(2 * hits, positives + predicted), _ratio(hits, predicted), recall, recall)


def _metric_table(stats: EvalStats | MultiLabelEvalStats, correct: float, balanced: np.ndarray, f1: np.ndarray,
                  precision: np.ndarray, macro_recall: np.ndarray, recall: np.ndarray) -> dict[str, MetricValue]:
    """The metrics both kinds report, from the per-class ratios each defines (macro means: 0 where undefined)."""
    pairs = list(zip(stats.pos_hist, stats.neg_hist))
    auc = np.array([binned_auc(p, n) for p, n in pairs])
    fca_auc = np.array([interpolated_auc(p, n) for p, n in pairs])  # NaN where a class lacks positives or negatives
    return {
        "accuracy": _scalar(correct / stats.count) if stats.count else None,
        "balanced_accuracy": _mean(balanced),
        "macro_f1": _mean(np.nan_to_num(f1)),
        "macro_precision": _mean(np.nan_to_num(precision)),
        "macro_recall": _mean(np.nan_to_num(macro_recall)),
        "auc_macro_ovr": _mean(auc[~np.isnan(auc)]),
        "bauc": _mean(fca_auc[~np.isnan(fca_auc)]),
        "per_class_recall": _list(recall),
        "per_class_auc": _list(auc),
        "loss": _scalar(stats.loss_sum / stats.count) if stats.count else None,
    }


def shot_groups_from_counts(class_counts: npt.ArrayLike, head_min: int, tail_max: int) -> dict[str, list[int]]:
    """Split classes by training count: head if count > head_min, tail if count < tail_max, medium otherwise
    (Fed-MAS on HyperKvasir: 700 and 70, spec §2(d)); ConfigError when the groups would overlap."""
    if tail_max > head_min + 1:
        raise ConfigError(f"tail_max ({tail_max}) must be <= head_min + 1 ({head_min + 1}) so groups do not overlap")
    counts = np.asarray(class_counts).reshape(-1)
    return {
        "head": [k for k, n in enumerate(counts) if n > head_min],
        "medium": [k for k, n in enumerate(counts) if tail_max <= n <= head_min],
        "tail": [k for k, n in enumerate(counts) if n < tail_max],
    }


def _group_accuracies(recall: np.ndarray, shot_groups: Mapping[str, Sequence[int]]) -> dict[str, MetricValue]:
    num_classes = len(recall)
    accuracies: dict[str, float | None] = {}
    for group, classes in shot_groups.items():
        outside = [k for k in classes if not 0 <= k < num_classes]
        if outside:
            raise ConfigError(f"shot group '{group}' names classes {outside} outside [0, {num_classes})")
        group_recall = recall[list(classes)] if classes else np.array([])
        accuracies[f"{group}_accuracy"] = _mean(group_recall[~np.isnan(group_recall)])
    values = list(accuracies.values())
    hmt_mean = None if not values or None in values else float(np.mean(values))
    return {**accuracies, "hmt_mean": hmt_mean}


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """Element-wise ratio, NaN where the denominator is 0."""
    return np.divide(numerator, denominator, out=np.full_like(numerator, np.nan), where=denominator > 0)


def _mean(values: np.ndarray) -> float | None:
    return float(np.mean(values)) if values.size else None


def _scalar(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _list(values: np.ndarray) -> list[float | None]:
    return [None if np.isnan(v) else float(v) for v in values]
