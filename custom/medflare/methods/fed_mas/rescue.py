"""Fed-MAS's rescue factor, as pure tensor/numpy functions (paper Eq. 3 and 5; spec §2(a) steps 2-4)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def distillation_distance(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-sample L_f = 2 - 2 <ŷ, ŷ'> with both features L2-normalised; shape [B], values in [0, 4]."""
    return 2 - 2 * (F.normalize(student, dim=1) * F.normalize(teacher, dim=1)).sum(dim=1)


class ClassMeanAccumulator:
    """Accumulates Σ_i L_f(x_i) per class and divides by the site's full class count M_k. Summing per-batch class means
    weighted by count_k/M_k (the authors' code) is the same number, so a pass over the data gives each class's mean
    distance, and E epochs give the sum of E per-epoch means."""

    def __init__(self, num_classes: int) -> None:
        self.sums = torch.zeros(num_classes, dtype=torch.float64)

    def add(self, labels: torch.Tensor, values: torch.Tensor) -> None:
        """Add a batch of per-sample values; unlabelled samples (label -1) are skipped."""
        keep = labels >= 0
        self.sums.index_add_(0, labels[keep].cpu(), values[keep].detach().double().cpu())

    def per_class(self, class_counts: np.ndarray) -> np.ndarray:
        """Σ L_f / M_k for every class; 0 for classes the site does not have."""
        counts = np.asarray(class_counts, dtype=np.float64)
        sums = self.sums.numpy()
        return np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)


# L_f = 2 - 2 cos lies in [0, 4], so a class's mean distance w_k does too, and ŵ_k, a sum of E per-epoch means, in
# [0, 4E]: the most Eq. 3's RF = Σ_k w_k ŵ_k can reach is K · 4 · 4E.
MAX_DISTANCE = 4.0


def rescue_factor(w: np.ndarray, w_hat: np.ndarray, invert: bool = False, normalise: bool = True) -> float:
    """RF = Σ_{k: w_k ≠ 0} w̄_k ŵ̄_k. ``w`` is the received global model's per-class distance before training, ``w_hat``
    the one accumulated during local training (``invert``, the ``mas_inv`` option: 1/ŵ_k for ŵ_k > 0). ``normalise``
    (the authors' code, spec §2(e)2): w̄, ŵ̄ are w, ŵ normalised to sum 1, so RF lies in (0, 1]: 1 for a one-class
    site, about 1/K_local for a site whose classes all look alike, whatever the scale of the distances. Without it,
    Eq. 3 as printed: w̄ = w, ŵ̄ = ŵ, so a site whose every class drifted further from the prior sends a larger RF
    (at most :func:`eq3_bound`). ValueError when no distance is positive."""
    w, w_hat = np.asarray(w, dtype=np.float64), np.asarray(w_hat, dtype=np.float64)
    if invert:
        w_hat = np.divide(1.0, w_hat, out=np.zeros_like(w_hat), where=w_hat > 0)
    if w.sum() <= 0 or w_hat.sum() <= 0:
        raise ValueError("rescue factor undefined: every per-class distance is zero")
    present = w != 0
    if normalise:
        w, w_hat = w / w.sum(), w_hat / w_hat.sum()
    return float(np.sum(w[present] * w_hat[present]))


def eq3_bound(num_classes: int, local_epochs: int) -> float:
    """The largest unnormalised RF (Eq. 3) a site of K classes training E local epochs can send: K · 4 · 4E."""
    return num_classes * MAX_DISTANCE * MAX_DISTANCE * max(1, local_epochs)


def stratified_subsample(labels: np.ndarray, per_class: int, seed: int | tuple[int, ...]) -> np.ndarray:
    """Sorted row indices of at most ``per_class`` labelled rows of each class, drawn without replacement (a class
    with fewer keeps them all); the same ``seed`` gives the same rows (``w_pass_per_class`` uses (site seed, round))."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    chosen = []
    for k in np.unique(labels[labels >= 0]):
        rows = np.flatnonzero(labels == k)
        chosen.append(rows if len(rows) <= per_class else rng.choice(rows, size=per_class, replace=False))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)
