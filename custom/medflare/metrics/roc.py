"""One-vs-rest ROC AUC from binned score histograms.

Within a bin all scores are treated as tied, which is exact for the ROC curve whose thresholds are the bin edges.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FCA_FPR_GRID_POINTS", "binned_auc", "binned_auc_error_bound", "binned_roc_curve", "interpolated_auc"]

#: FCA evaluates each class's ROC curve on this many equally spaced false-positive rates in [0, 1].
FCA_FPR_GRID_POINTS = 1000


def binned_auc(pos_hist: np.ndarray, neg_hist: np.ndarray) -> float:
    """Area under the ROC curve of one class from its score histograms over its own / the other samples:
    P(score_pos > score_neg) + ½ P(same bin), the trapezoidal area under :func:`binned_roc_curve`; NaN without
    positives or negatives."""
    positives, negatives = float(pos_hist.sum()), float(neg_hist.sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    positives_above = positives - np.cumsum(pos_hist)  # positives in strictly higher bins
    return float(np.sum(neg_hist * (positives_above + 0.5 * pos_hist)) / (positives * negatives))


def binned_auc_error_bound(pos_hist: np.ndarray, neg_hist: np.ndarray) -> float:
    """Largest possible gap between :func:`binned_auc` and the exact AUC of the scores behind the histograms.

    Only a (positive, negative) pair in the same bin can be ordered differently by the exact scores; the binned
    AUC counts each such pair as ½, the exact AUC as 0, ½ or 1. So the gap is at most
    ½ · Σ_b pos_b · neg_b / (P · N). NaN if there are no positives or no negatives.
    """
    positives, negatives = float(pos_hist.sum()), float(neg_hist.sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    return float(0.5 * np.sum(pos_hist.astype(np.float64) * neg_hist) / (positives * negatives))


def binned_roc_curve(pos_hist: np.ndarray, neg_hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False- and true-positive rates as the threshold moves down the bin edges, starting at (0, 0).

    Both returned arrays are non-decreasing and end at (1, 1). Requires at least one positive and one negative.
    """
    tpr = np.concatenate([[0.0], np.cumsum(pos_hist[::-1]) / pos_hist.sum()])
    fpr = np.concatenate([[0.0], np.cumsum(neg_hist[::-1]) / neg_hist.sum()])
    return fpr, tpr


def interpolated_auc(pos_hist: np.ndarray, neg_hist: np.ndarray, grid_points: int = FCA_FPR_GRID_POINTS) -> float:
    """FCA's per-class AUC: the ROC's TPR read at ``grid_points`` equally spaced FPRs, integrated by trapezoid.

    Where the curve is vertical (several TPRs at one FPR) the highest TPR is read, as ``np.interp`` does on
    scikit-learn's ``roc_curve`` output in the FCA code. NaN if there are no positives or no negatives.

    References:
        Wicaksana et al., FCA: Taming Long-tailed Federated Medical Image Classification by Classifier
        Anchoring, 2023 (``helper.py::test``).
    """
    if pos_hist.sum() == 0 or neg_hist.sum() == 0:
        return float("nan")
    fpr, tpr = binned_roc_curve(pos_hist, neg_hist)
    grid = np.linspace(0.0, 1.0, grid_points)
    # Last curve point at or left of each grid FPR (the highest TPR on a vertical stretch), then linear
    # interpolation towards the next point.
    left = np.searchsorted(fpr, grid, side="right") - 1
    right = np.minimum(left + 1, len(fpr) - 1)
    span = fpr[right] - fpr[left]
    fraction = np.divide(grid - fpr[left], span, out=np.zeros_like(grid), where=span > 0)
    tpr_on_grid = np.where(span > 0, tpr[left] + fraction * (tpr[right] - tpr[left]), tpr[left])
    return float(np.trapezoid(tpr_on_grid, grid))
