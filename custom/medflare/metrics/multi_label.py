"""Summable evaluation statistics of multi-label classification (several findings per image): per class, 2×2
confusion counts at threshold 0.5 and score histograms of positives and negatives, so per-class AUROC and macro F1
pool exactly or within :func:`~medflare.metrics.roc.binned_auc_error_bound`. Unknown entries (-1) count nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from medflare.errors import DataError, MedflareError, PayloadError
from medflare.metrics.eval_stats import (
    _PROB_TOLERANCE,
    DEFAULT_BINS,
    SummableStats,
    _count_array,
    _to_numpy,
    score_bins,
)

__all__ = ["THRESHOLD", "MultiLabelEvalStats"]

THRESHOLD = 0.5  # a finding is predicted present when its sigmoid score is at least this
FIELDS = ("confusion", "pos_hist", "neg_hist", "exact", "loss_sum", "count")


@dataclass
class MultiLabelEvalStats(SummableStats):
    """Sufficient statistics of one multi-label evaluation, closed under addition: ``confusion[k, t, p]`` counts
    class k's known entries with truth t and prediction p; ``pos_hist``/``neg_hist`` ``[K, bins]`` histogram class
    k's score where it is present / known absent; ``exact``: samples with every known entry right; ``loss_sum``:
    their mean BCE over known entries, summed; ``count``: samples with at least one known entry."""

    confusion: np.ndarray
    pos_hist: np.ndarray
    neg_hist: np.ndarray
    exact: int = 0
    loss_sum: float = 0.0
    count: int = 0

    KIND = "multi-label EvalStats"

    def __post_init__(self) -> None:
        _check_consistent(self.confusion, self.pos_hist, self.neg_hist, self.exact, self.count, DataError)

    @classmethod
    def zeros(cls, num_classes: int, bins: int = DEFAULT_BINS) -> MultiLabelEvalStats:
        """Empty statistics, the neutral element of ``+``."""
        hist = np.zeros((num_classes, bins), dtype=np.int64)
        return cls(np.zeros((num_classes, 2, 2), dtype=np.int64), hist, hist.copy())

    @classmethod
    def from_predictions(
        cls, y_true: npt.ArrayLike, probs: npt.ArrayLike, num_classes: int, bins: int = DEFAULT_BINS,
        loss_sum: float = 0.0,
    ) -> MultiLabelEvalStats:
        """Statistics of multi-hot labels ``[N, K]`` (1, 0, -1 unknown; a row with none known counts nowhere) and
        sigmoid scores ``[N, K]``.

        Raises:
            DataError: for mismatched shapes, entries other than 1/0/-1, or scores that are not in [0, 1].
        """
        labels = _to_numpy(y_true).astype(np.int64, copy=False)
        scores = _to_numpy(probs).astype(np.float64, copy=False)
        _check_predictions(labels, scores, num_classes)
        rows = (labels >= 0).any(axis=1)
        labels, scores = labels[rows], scores[rows]
        known, predicted = labels >= 0, (scores >= THRESHOLD).astype(np.int64)
        cell = np.where(known, 2 * labels + predicted, 4)  # 4 = unknown, dropped below
        offsets = 5 * np.arange(num_classes, dtype=np.int64)
        confusion = np.bincount((cell + offsets).reshape(-1), minlength=5 * num_classes).reshape(num_classes, 5)[:, :4]
        bin_index = score_bins(scores, bins) + bins * np.arange(num_classes, dtype=np.int64)
        size = num_classes * bins
        pos_hist = np.bincount(bin_index[labels == 1], minlength=size).reshape(num_classes, bins)
        neg_hist = np.bincount(bin_index[labels == 0], minlength=size).reshape(num_classes, bins)
        exact = int(np.all((predicted == labels) | ~known, axis=1).sum())
        return cls(confusion.reshape(num_classes, 2, 2).astype(np.int64), pos_hist.astype(np.int64),
                   neg_hist.astype(np.int64), exact=exact, loss_sum=float(loss_sum), count=int(rows.sum()))

    @classmethod
    def from_dict(cls, data: Any, num_classes: int | None = None, bins: int | None = None) -> MultiLabelEvalStats:
        """Rebuild statistics received from another party, validating them.

        Raises:
            PayloadError: for missing fields, wrong shapes, negative or non-integer counts, inconsistent totals,
                or a K / bins other than the expected ones.
        """
        if not isinstance(data, dict):
            raise PayloadError(f"multi-label EvalStats payload must be a dict, got {type(data).__name__}")
        missing = set(FIELDS) - set(data)
        if missing:
            raise PayloadError(f"multi-label EvalStats payload lacks {sorted(missing)}")
        confusion = _count_array(data["confusion"], "confusion", ndim=3)
        pos_hist, neg_hist = _count_array(data["pos_hist"], "pos_hist"), _count_array(data["neg_hist"], "neg_hist")
        exact, count = (_whole(data[key], key) for key in ("exact", "count"))
        loss_sum = data["loss_sum"]
        if isinstance(loss_sum, bool) or not isinstance(loss_sum, (int, float, np.number)) or not np.isfinite(loss_sum):
            raise PayloadError(f"EvalStats 'loss_sum' must be a finite number, got {loss_sum!r}")
        _check_consistent(confusion, pos_hist, neg_hist, exact, count, PayloadError)
        if num_classes is not None and confusion.shape[0] != num_classes:
            raise PayloadError(f"EvalStats has K={confusion.shape[0]}, expected {num_classes}")
        if bins is not None and pos_hist.shape[1] != bins:
            raise PayloadError(f"EvalStats has {pos_hist.shape[1]} bins, expected {bins}")
        return cls(confusion, pos_hist, neg_hist, exact=exact, loss_sum=float(loss_sum), count=count)


def _whole(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise PayloadError(f"EvalStats '{name}' must be an integer >= 0, got {value!r}")
    return int(value)


def _check_predictions(labels: np.ndarray, scores: np.ndarray, num_classes: int) -> None:
    if labels.ndim != 2 or labels.shape[1] != num_classes or scores.shape != labels.shape:
        raise DataError(f"multi-label labels and probs must both be [N, K={num_classes}], got {list(labels.shape)} "
                        f"and {list(scores.shape)}")
    if labels.size and not np.isin(labels, (-1, 0, 1)).all():
        raise DataError("multi-label entries must be 1, 0 or -1 (unknown)")
    if scores.size and (not np.isfinite(scores).all() or scores.min() < -_PROB_TOLERANCE
                        or scores.max() > 1 + _PROB_TOLERANCE):
        raise DataError("probs must be finite sigmoid scores in [0, 1] (pass sigmoid outputs, not logits)")


def _check_consistent(confusion: np.ndarray, pos_hist: np.ndarray, neg_hist: np.ndarray, exact: int, count: int,
                      error: type[MedflareError]) -> None:
    """Shapes agree; each class's histograms hold exactly its known positives and negatives; no total exceeds
    the number of samples."""
    k = confusion.shape[0] if confusion.ndim == 3 else -1
    if confusion.shape != (k, 2, 2) or k < 1:
        raise error(f"multi-label confusion must be [K, 2, 2], got {list(confusion.shape)}")
    if pos_hist.ndim != 2 or pos_hist.shape[0] != k or pos_hist.shape[1] < 1 or neg_hist.shape != pos_hist.shape:
        raise error(f"pos_hist and neg_hist must both be [K={k}, bins], got {list(pos_hist.shape)} and "
                    f"{list(neg_hist.shape)}")
    if not np.array_equal(pos_hist.sum(axis=1), confusion[:, 1].sum(axis=1)):
        raise error("pos_hist row totals must equal each class's known positives")
    if not np.array_equal(neg_hist.sum(axis=1), confusion[:, 0].sum(axis=1)):
        raise error("neg_hist row totals must equal each class's known negatives")
    if confusion.sum(axis=(1, 2)).max() > count or exact > count:
        raise error(f"a class counts more known entries, or exact matches, than the {count} samples")
