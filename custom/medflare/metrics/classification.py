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
    """Metrics of the pooled predictions summarised by ``stats``; binary (K = 2) is handled like any K.

    Multi-label statistics give :func:`multi_label_metrics` (``shot_groups`` do not apply to them).

    Returned keys (an undefined value, e.g. on an empty set, is None rather than NaN so it serialises to JSON):

    * ``accuracy``: top-1 accuracy.
    * ``balanced_accuracy``: mean recall over the classes present in y_true (sklearn ``balanced_accuracy_score``).
    * ``macro_f1``, ``macro_precision``, ``macro_recall``: unweighted means over the classes present in y_true or
      in the predictions, with 0 for an undefined ratio (sklearn ``f1_score`` / ``precision_score`` /
      ``recall_score`` with ``average="macro"``; the "macro avg" row of ``classification_report``).
    * ``auc_macro_ovr``: mean one-vs-rest ROC AUC over the classes with both positives and negatives, from the
      score histograms: sklearn ``roc_auc_score(multi_class="ovr", average="macro")`` up to ties inside a bin,
      at most :func:`~medflare.metrics.roc.binned_auc_error_bound` per class (below 1e-3 in the tests, also
      for saturated softmax outputs).
    * ``bauc``: FCA's balanced AUC, the same mean with each class's ROC read on a 1000-point FPR grid.
    * ``per_class_recall``, ``per_class_auc``: lists of length K, None where undefined.
    * ``loss``: ``loss_sum / count``.
    * With ``shot_groups``: ``<group>_accuracy`` for each group (e.g. ``head_accuracy``) and ``hmt_mean``.

    Assumption (spec §1.5): a group's accuracy is the mean per-class recall over the group's classes present in
    the test set, the long-tail convention; Fed-MAS's code does not define it. ``hmt_mean`` is the plain mean of
    the group accuracies (Fed-MAS's "All") and is None if any group is undefined.

    Args:
        stats: summed statistics of the evaluation.
        shot_groups: group name -> class indices, e.g. from :func:`shot_groups_from_counts`.

    Raises:
        ConfigError: if a shot group names a class outside [0, K).
    """
    if isinstance(stats, MultiLabelEvalStats):
        return multi_label_metrics(stats)
    confusion = stats.confusion.astype(np.float64)
    true_counts, predicted_counts, hits = confusion.sum(axis=1), confusion.sum(axis=0), np.diag(confusion)
    present = true_counts > 0
    labelled_or_predicted = present | (predicted_counts > 0)

    recall = _ratio(hits, true_counts)
    precision = _ratio(hits, predicted_counts)
    f1 = _ratio(2 * hits, true_counts + predicted_counts)
    auc, fca_auc = _per_class_aucs(stats)

    metrics: dict[str, MetricValue] = {
        "accuracy": _scalar(hits.sum() / stats.count) if stats.count else None,
        "balanced_accuracy": _mean(recall[present]),
        "macro_f1": _mean(np.nan_to_num(f1[labelled_or_predicted])),
        "macro_precision": _mean(np.nan_to_num(precision[labelled_or_predicted])),
        "macro_recall": _mean(np.nan_to_num(recall[labelled_or_predicted])),
        "auc_macro_ovr": _mean(auc[~np.isnan(auc)]),
        "bauc": _mean(fca_auc[~np.isnan(fca_auc)]),
        "per_class_recall": _list(recall),
        "per_class_auc": _list(auc),
        "loss": _scalar(stats.loss_sum / stats.count) if stats.count else None,
    }
    if shot_groups is not None:
        metrics.update(_group_accuracies(recall, shot_groups))
    return metrics


def multi_label_metrics(stats: MultiLabelEvalStats) -> dict[str, MetricValue]:
    """Metrics of pooled multi-label predictions (threshold 0.5); each class is scored as its own binary task.

    * ``auc_macro_ovr``: the mean of the per-class AUROCs over classes with known positives and negatives
      (FedLSM's "Average AUC", sklearn ``roc_auc_score(average="macro")`` on the indicator matrix), up to
      :func:`~medflare.metrics.roc.binned_auc_error_bound` per class; ``per_class_auc`` lists them.
    * ``macro_f1``, ``macro_precision``, ``macro_recall``: unweighted means over all K classes, 0 where a
      class's ratio is undefined (sklearn ``average="macro"``, ``zero_division=0``).
    * ``accuracy``: subset accuracy, the share of samples whose every known entry is right (sklearn
      ``accuracy_score`` on fully labelled rows).
    * ``balanced_accuracy``: the mean over classes with known positives and negatives of ½(sensitivity +
      specificity); ``per_class_recall``: each class's sensitivity.
    * ``bauc`` (FCA's grid-interpolated AUC) and ``loss`` (mean BCE) as for single-label statistics.
    """
    hits = stats.confusion[:, 1, 1].astype(np.float64)
    positives = stats.confusion[:, 1].sum(axis=1).astype(np.float64)
    negatives = stats.confusion[:, 0].sum(axis=1).astype(np.float64)
    predicted = stats.confusion[:, :, 1].sum(axis=1).astype(np.float64)
    recall = _ratio(hits, positives)
    specificity = _ratio(stats.confusion[:, 0, 0].astype(np.float64), negatives)
    both = (positives > 0) & (negatives > 0)
    auc, fca_auc = _per_class_aucs(stats)
    return {
        "accuracy": _scalar(stats.exact / stats.count) if stats.count else None,
        "balanced_accuracy": _mean(0.5 * (recall[both] + specificity[both])),
        "macro_f1": _mean(np.nan_to_num(_ratio(2 * hits, positives + predicted))),
        "macro_precision": _mean(np.nan_to_num(_ratio(hits, predicted))),
        "macro_recall": _mean(np.nan_to_num(recall)),
        "auc_macro_ovr": _mean(auc[~np.isnan(auc)]),
        "bauc": _mean(fca_auc[~np.isnan(fca_auc)]),
        "per_class_recall": _list(recall),
        "per_class_auc": _list(auc),
        "loss": _scalar(stats.loss_sum / stats.count) if stats.count else None,
    }


def _per_class_aucs(stats: EvalStats | MultiLabelEvalStats) -> tuple[np.ndarray, np.ndarray]:
    """Each class's binned AUC and FCA's grid-interpolated AUC (NaN where a class lacks positives or negatives)."""
    pairs = list(zip(stats.pos_hist, stats.neg_hist))
    return np.array([binned_auc(p, n) for p, n in pairs]), np.array([interpolated_auc(p, n) for p, n in pairs])


def shot_groups_from_counts(class_counts: npt.ArrayLike, head_min: int, tail_max: int) -> dict[str, list[int]]:
    """Split classes by training count: head if count > head_min, tail if count < tail_max, medium otherwise.

    Fed-MAS on HyperKvasir uses the total training counts with head_min = 700 and tail_max = 70 (spec §2(d)).

    Raises:
        ConfigError: if tail_max > head_min + 1, which would put a class in both head and tail.
    """
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
