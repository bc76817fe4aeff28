"""Byzantine-robust aggregation rules over the sites' flattened updates, pure numpy (issue 49, item 3).

Each rule takes the sites' model vectors (one row per site, the same length) and returns the aggregate vector, as
its paper defines it:

- :func:`coordinate_median` and :func:`trimmed_mean`: Yin et al., "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018 (Definitions 1 and 2: per coordinate, the median; the mean after removing
  the β fraction of largest and of smallest values).
- :func:`krum_scores`, :func:`krum` and :func:`multi_krum`: Blanchard et al., "Machine Learning with Adversaries:
  Byzantine Tolerant Gradient Descent", NeurIPS 2017 (§4: a vector's score is the sum of squared distances to its
  n − f − 2 closest other vectors; Krum picks the lowest score, Multi-Krum averages the m lowest).
- :func:`bulyan`: El Mhamdi et al., "The Hidden Vulnerability of Distributed Learning in Byzantium", ICML 2018
  (Algorithm 1: θ = n − 2f vectors chosen by Krum one at a time, each removed from the pool; then per coordinate
  the mean of the β = θ − 2f values closest to the median of the chosen ones; n ≥ 4f + 3). Where the shrinking
  pool holds fewer than f + 3 updates, a Krum score sums over the one nearest neighbour (the paper leaves it open).

Not yet selectable in a job (``robust.rule``): the next step puts them in the aggregation's choke point.
"""

from __future__ import annotations

import numpy as np

from medflare.errors import ConfigError


def _stacked(updates: np.ndarray) -> np.ndarray:
    stacked = np.asarray(updates, dtype=np.float64)
    if stacked.ndim != 2 or stacked.shape[0] == 0:
        raise ConfigError(f"robust rules take one flattened update per site ([sites, values]), got {stacked.shape}")
    return stacked


def coordinate_median(updates: np.ndarray) -> np.ndarray:
    """Per coordinate, the median over the sites (the mean of the two middle values for an even count)."""
    return np.median(_stacked(updates), axis=0)


def trimmed_mean(updates: np.ndarray, beta: float) -> np.ndarray:
    """Per coordinate, the mean after removing the ⌊β·n⌋ largest and the ⌊β·n⌋ smallest values (0 ≤ β < 1/2)."""
    stacked = _stacked(updates)
    if not 0 <= beta < 0.5:
        raise ConfigError(f"trimmed mean: beta must be in [0, 0.5), got {beta}")
    cut = int(beta * stacked.shape[0])
    ordered = np.sort(stacked, axis=0)
    return ordered[cut: stacked.shape[0] - cut].mean(axis=0)


def krum_scores(updates: np.ndarray, f: int, neighbours: int | None = None) -> np.ndarray:
    """Each site's Krum score: the sum of squared distances to its n − f − 2 nearest other sites (n > f + 2), or to
    its ``neighbours`` nearest when given."""
    stacked = _stacked(updates)
    n = stacked.shape[0]
    k = n - f - 2 if neighbours is None else neighbours
    if f < 0 or not 1 <= k <= n - 1:
        raise ConfigError(f"Krum needs n - f - 2 >= 1 (n = {n} sites, f = {f} assumed Byzantine)")
    squared = np.sum((stacked[:, None, :] - stacked[None, :, :]) ** 2, axis=-1)
    nearest = np.sort(squared + np.diag(np.full(n, np.inf)), axis=1)[:, :k]
    return nearest.sum(axis=1)


def krum(updates: np.ndarray, f: int) -> np.ndarray:
    """The update with the lowest Krum score (the first one on a tie)."""
    return _stacked(updates)[int(np.argmin(krum_scores(updates, f)))]


def multi_krum(updates: np.ndarray, f: int, m: int) -> np.ndarray:
    """The mean of the ``m`` updates with the lowest Krum scores (1 ≤ m ≤ n; m = 1 is Krum)."""
    stacked = _stacked(updates)
    if not 1 <= m <= stacked.shape[0]:
        raise ConfigError(f"Multi-Krum keeps 1 to {stacked.shape[0]} updates, got m = {m}")
    chosen = np.argsort(krum_scores(stacked, f), kind="stable")[:m]
    return stacked[chosen].mean(axis=0)


def bulyan(updates: np.ndarray, f: int) -> np.ndarray:
    """Bulyan over Krum: θ = n − 2f updates chosen by Krum one at a time, then per coordinate the mean of the
    β = θ − 2f chosen values closest to their median (n ≥ 4f + 3)."""
    stacked = _stacked(updates)
    n = stacked.shape[0]
    if f < 0 or n < 4 * f + 3:
        raise ConfigError(f"Bulyan needs n >= 4f + 3 (n = {n} sites, f = {f} assumed Byzantine)")
    pool, chosen = list(range(n)), []
    for _ in range(n - 2 * f):
        # the last picks leave fewer than f + 3 in the pool, where Krum's n − f − 2 is < 1: the nearest one counts
        scores = krum_scores(stacked[pool], f, max(len(pool) - f - 2, 1)) if len(pool) > 1 else np.zeros(1)
        chosen.append(pool.pop(int(np.argmin(scores))))
    selected = stacked[chosen]
    beta = len(chosen) - 2 * f
    median = np.median(selected, axis=0)
    closest = np.argsort(np.abs(selected - median), axis=0, kind="stable")[:beta]
    return np.take_along_axis(selected, closest, axis=0).mean(axis=0)
