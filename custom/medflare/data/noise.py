"""Label-noise injection of MDH-FL/RHFL (spec §1.3): a class transition matrix and per-sample draws."""

from __future__ import annotations

import numpy as np

from medflare.data.types import UNLABELED
from medflare.errors import ConfigError, DataError

NOISE_KINDS = ("symmetric", "pairflip")


def noise_transition_matrix(num_classes: int, rate: float, kind: str) -> np.ndarray:
    """Row-stochastic `[K, K]` matrix P with P[i, j] = probability that true class i is recorded as j.

    Args:
        num_classes: Number of classes K (>= 2).
        rate: Flip probability μ in [0, 1].
        kind: "symmetric" (1-μ on the diagonal, μ/(K-1) elsewhere) or "pairflip" (1-μ on the diagonal,
            μ at (i, (i+1) mod K)).

    Raises:
        ConfigError: Unknown kind, fewer than 2 classes, or a rate outside [0, 1].
    """
    if kind not in NOISE_KINDS:
        raise ConfigError(f"Unknown label-noise kind '{kind}'; use one of {', '.join(NOISE_KINDS)}.")
    if num_classes < 2:
        raise ConfigError(f"Label noise needs at least 2 classes, got {num_classes}.")
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"Label-noise rate must be in [0, 1], got {rate}.")
    if kind == "symmetric":
        matrix = np.full((num_classes, num_classes), rate / (num_classes - 1))
    else:
        matrix = np.zeros((num_classes, num_classes))
        matrix[np.arange(num_classes), (np.arange(num_classes) + 1) % num_classes] = rate
    np.fill_diagonal(matrix, 1.0 - rate)
    return matrix


def inject_label_noise(labels: np.ndarray, num_classes: int, rate: float, kind: str, seed: int = 0) -> np.ndarray:
    """Returns a noisy copy of `labels`: one multinomial draw on row P[y] per sample, in array order.

    Uses `numpy.random.RandomState(seed)` as RHFL does (seed 0 reproduces its noise). `UNLABELED` (-1)
    samples stay -1 and consume no draw. Apply to training labels only; evaluation labels stay clean.
    """
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    matrix = noise_transition_matrix(num_classes, rate, kind)
    bad = (labels < UNLABELED) | (labels >= num_classes)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(f"Label {labels[row]} at row {row} is outside [0, {num_classes}); cannot inject noise.")
    noisy = labels.copy()
    if rate == 0.0:
        return noisy
    state = np.random.RandomState(seed)
    for i in np.flatnonzero(labels != UNLABELED):
        noisy[i] = int(np.argmax(state.multinomial(1, matrix[labels[i]])))
    return noisy
