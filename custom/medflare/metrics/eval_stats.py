"""Summable evaluation statistics: sites send these, the server adds them and computes pooled metrics.

Confusion counts give exact pooled accuracy, balanced accuracy and F1; per-class score histograms give ROC AUC
up to ties inside a bin (see :func:`score_bins` and :func:`medflare.metrics.roc.binned_auc_error_bound`).
Nothing per-sample leaves a site.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from medflare.errors import DataError, MedflareError, PayloadError

MAX_COUNT = 100_000_000  # no site trains on or evaluates more images: a larger count is forged (contracts.MAX_SAMPLES)

__all__ = ["DEFAULT_BINS", "EvalStats", "score_bins"]

DEFAULT_BINS = 1000
# The logit range the bins cover: float32 softmax outputs lie in logit [-103.3, 16.6] (smallest denormal, largest
# float below 1) and float64 ones above -110 in practice; beyond the range scores share the end bins.
_LOGIT_RANGE = (-110.0, 40.0)
# Softmax outputs may overshoot [0, 1] by rounding; anything further out is not a probability.
_PROB_TOLERANCE = 1e-4
Stats = TypeVar("Stats", bound="SummableStats")


class SummableStats:
    """What single- and multi-label statistics share: arrays and counts that add field by field."""

    KIND = "EvalStats"  # how messages name the kind
    confusion: np.ndarray
    pos_hist: np.ndarray

    @property
    def num_classes(self) -> int:
        """K."""
        return int(self.confusion.shape[0])

    @property
    def bins(self) -> int:
        """Number of score bins (see :func:`score_bins`)."""
        return int(self.pos_hist.shape[1])

    def __add__(self: Stats, other: Stats) -> Stats:
        """Statistics of the union of both evaluations."""
        if not isinstance(other, type(self)):
            return NotImplemented
        if (self.num_classes, self.bins) != (other.num_classes, other.bins):
            raise DataError(f"cannot add {self.KIND} with K={self.num_classes}, bins={self.bins} and "
                            f"K={other.num_classes}, bins={other.bins}")
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __radd__(self: Stats, other: Any) -> Stats:
        """Lets ``sum(list_of_stats)`` start from 0."""
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and numbers (JSON/msgpack-serialisable) for a FLARE message."""
        return {f.name: _plain(f.name, getattr(self, f.name)) for f in fields(self)}


def _plain(name: str, value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    return float(value) if name == "loss_sum" else int(value)


@dataclass
class EvalStats(SummableStats):
    """Sufficient statistics of one evaluation, closed under addition: int64 ``confusion`` ``[K, K]`` (rows true,
    columns predicted), and ``pos_hist``/``neg_hist`` ``[K, bins]`` (row k: class k's score over samples of class
    k / of every other class), the summed per-sample loss and the sample count."""

    confusion: np.ndarray
    pos_hist: np.ndarray
    neg_hist: np.ndarray
    loss_sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        _check_consistent(self.confusion, self.pos_hist, self.neg_hist, self.count, DataError)

    @classmethod
    def zeros(cls, num_classes: int, bins: int = DEFAULT_BINS) -> EvalStats:
        """Empty statistics, the neutral element of ``+``."""
        return cls(
            confusion=np.zeros((num_classes, num_classes), dtype=np.int64),
            pos_hist=np.zeros((num_classes, bins), dtype=np.int64),
            neg_hist=np.zeros((num_classes, bins), dtype=np.int64),
        )

    @classmethod
    def from_predictions(
        cls,
        y_true: npt.ArrayLike,
        probs: npt.ArrayLike,
        num_classes: int,
        bins: int = DEFAULT_BINS,
        loss_sum: float = 0.0,
    ) -> EvalStats:
        """Statistics of predictions: true classes ``[N]`` and softmax probabilities ``[N, K]`` (numpy or torch).

        Raises:
            DataError: for mismatched shapes, labels outside [0, K), or scores that are not probabilities.
        """
        labels = _to_numpy(y_true).astype(np.int64, copy=False).reshape(-1)
        scores = _to_numpy(probs).astype(np.float64, copy=False)
        _check_predictions(labels, scores, num_classes)
        n = labels.shape[0]
        predicted = scores.argmax(axis=1) if n else np.zeros(0, dtype=np.int64)
        confusion = np.bincount(labels * num_classes + predicted, minlength=num_classes * num_classes)
        score_bin = score_bins(scores, bins)
        class_offsets = np.arange(num_classes, dtype=np.int64) * bins
        all_hist = np.bincount((score_bin + class_offsets).reshape(-1), minlength=num_classes * bins)
        true_bins = score_bin[np.arange(n), labels]
        pos_hist = np.bincount(labels * bins + true_bins, minlength=num_classes * bins)
        return cls(
            confusion=confusion.reshape(num_classes, num_classes).astype(np.int64),
            pos_hist=pos_hist.reshape(num_classes, bins).astype(np.int64),
            neg_hist=(all_hist - pos_hist).reshape(num_classes, bins).astype(np.int64),
            loss_sum=float(loss_sum),
            count=int(n),
        )

    @classmethod
    def from_dict(cls, data: Any, num_classes: int | None = None, bins: int | None = None) -> EvalStats:
        """Rebuild :meth:`to_dict`'s output received from another party; PayloadError for missing fields, wrong
        shapes, bad or inconsistent counts, or a K / bins other than the expected ones."""
        if not isinstance(data, dict):
            raise PayloadError(f"EvalStats payload must be a dict, got {type(data).__name__}")
        missing = {"confusion", "pos_hist", "neg_hist", "loss_sum", "count"} - set(data)
        if missing:
            raise PayloadError(f"EvalStats payload lacks {sorted(missing)}")
        confusion, pos_hist, neg_hist = (_count_array(data[key], key) for key in ("confusion", "pos_hist", "neg_hist"))
        count, loss_sum = data["count"], data["loss_sum"]
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or not 0 <= count <= MAX_COUNT:
            raise PayloadError(f"EvalStats 'count' must be an integer in [0, {MAX_COUNT:,}], got {count!r}")
        if not isinstance(loss_sum, (int, float, np.number)) or not np.isfinite(loss_sum):
            raise PayloadError(f"EvalStats 'loss_sum' must be a finite number, got {loss_sum!r}")
        _check_consistent(confusion, pos_hist, neg_hist, int(count), PayloadError)
        if num_classes is not None and confusion.shape[0] != num_classes:
            raise PayloadError(f"EvalStats has K={confusion.shape[0]}, expected {num_classes}")
        if bins is not None and pos_hist.shape[1] != bins:
            raise PayloadError(f"EvalStats has {pos_hist.shape[1]} bins, expected {bins}")
        return cls(confusion, pos_hist, neg_hist, loss_sum=float(loss_sum), count=int(count))


def score_bins(scores: np.ndarray, bins: int) -> np.ndarray:
    """int64 histogram bin of each probability, bins equally spaced in ``u = ½·p + ½·(logit p − a)/(b − a)``.

    Equal-width bins on p merge every saturated score of a confident model into the end bins, as ties (AUC read
    0.005 and more too low). Half the resolution here is linear in p and half in logit p over [a, b] = [−110, 40]
    (about 0.3 in logit per bin at 1000 bins). ``u`` is strictly increasing, so the bins keep the scores' order.
    """
    low, high = _LOGIT_RANGE
    p = np.clip(scores, 0.0, 1.0)
    with np.errstate(divide="ignore"):
        logit = np.clip(np.log(p) - np.log1p(-p), low, high)  # ±inf at exactly 0 or 1 clip to the range ends
    position = 0.5 * p + 0.5 * (logit - low) / (high - low)
    return np.clip(np.floor(position * bins).astype(np.int64), 0, bins - 1)


def _to_numpy(values: npt.ArrayLike) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, possibly on a GPU
        values = values.detach().cpu().numpy()  # type: ignore[union-attr]
    return np.asarray(values)


def _check_predictions(labels: np.ndarray, scores: np.ndarray, num_classes: int) -> None:
    if scores.ndim != 2 or scores.shape != (labels.shape[0], num_classes):
        raise DataError(f"probs must have shape [N={labels.shape[0]}, K={num_classes}], got {list(scores.shape)}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"labels must be in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
    if scores.size and (
        not np.isfinite(scores).all() or scores.min() < -_PROB_TOLERANCE or scores.max() > 1 + _PROB_TOLERANCE
    ):
        raise DataError("probs must be finite probabilities in [0, 1] (pass softmax outputs, not logits)")


def _count_array(value: Any, name: str, ndim: int = 2) -> np.ndarray:
    """A received ``ndim``-D array of non-negative integer counts."""
    try:
        array = np.asarray(value)
    except Exception as exc:  # ragged nested lists
        raise PayloadError(f"EvalStats '{name}' is not a rectangular array: {exc}") from exc
    if array.ndim != ndim or array.dtype.kind not in "iu":
        raise PayloadError(f"EvalStats '{name}' must be a {ndim}-D array of integers, got {array.ndim}-D {array.dtype}")
    if (array < 0).any():
        raise PayloadError(f"EvalStats '{name}' has negative counts")
    if array.size and array.max() > MAX_COUNT:  # before the cast: an unsigned 2^64 - 1 would wrap to -1
        raise PayloadError(f"EvalStats '{name}' counts more than {MAX_COUNT:,} samples in one cell")
    return array.astype(np.int64)


def _check_consistent(
    confusion: np.ndarray, pos_hist: np.ndarray, neg_hist: np.ndarray, count: int, error: type[MedflareError]
) -> None:
    """Shapes agree and every sample is counted once in the confusion and in each class's histogram."""
    k = confusion.shape[0] if confusion.ndim == 2 else -1
    if confusion.shape != (k, k) or k < 1:
        raise error(f"confusion must be a square [K, K] array, got {list(confusion.shape)}")
    if pos_hist.ndim != 2 or pos_hist.shape[0] != k or pos_hist.shape[1] < 1 or neg_hist.shape != pos_hist.shape:
        shapes = f"{list(pos_hist.shape)} and {list(neg_hist.shape)}"
        raise error(f"pos_hist and neg_hist must both be [K={k}, bins], got {shapes}")
    if int(confusion.sum()) != count:
        raise error(f"confusion counts {int(confusion.sum())} samples but count is {count}")
    if not np.array_equal(pos_hist.sum(axis=1), confusion.sum(axis=1)):
        raise error("pos_hist row totals must equal the number of true samples of each class")
    if not np.array_equal(neg_hist.sum(axis=1), count - confusion.sum(axis=1)):
        raise error("neg_hist row totals must equal the number of samples of the other classes")
