"""Federated evaluation: sites send summable :class:`EvalStats` (:class:`MultiLabelEvalStats` for multi-label
tasks), the server sums them and calls :func:`compute_metrics`, which gives the same values as scikit-learn on the
pooled predictions."""

from medflare.metrics.classification import (
    compute_metrics,
    multi_label_metrics,
    shot_groups_from_counts,
    stats_from_dict,
)
from medflare.metrics.eval_stats import DEFAULT_BINS, EvalStats, score_bins
from medflare.metrics.multi_label import MultiLabelEvalStats
from medflare.metrics.roc import binned_auc, binned_auc_error_bound, binned_roc_curve, interpolated_auc

__all__ = [
    "DEFAULT_BINS",
    "EvalStats",
    "MultiLabelEvalStats",
    "binned_auc",
    "binned_auc_error_bound",
    "binned_roc_curve",
    "compute_metrics",
    "interpolated_auc",
    "multi_label_metrics",
    "score_bins",
    "shot_groups_from_counts",
    "stats_from_dict",
]
