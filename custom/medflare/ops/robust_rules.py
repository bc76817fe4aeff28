"""Byzantine-robust aggregation rules over the sites' updates, pure numpy (issue 49, item 3), as their papers
define them: coordinate median and trimmed mean (Yin et al., ICML 2018, Definitions 1 and 2); Krum and
Multi-Krum (Blanchard et al., NeurIPS 2017, §4: the sum of squared distances to the n − f − 2 closest others);
Bulyan (El Mhamdi et al., ICML 2018, Algorithm 1; where the shrinking pool holds fewer than f + 3 updates a Krum
score sums over the one nearest neighbour, as Flower does).

Under ``robust.rule`` the selecting rules choose sites (treated like sites the norm bound rejected); the
coordinate rules weigh each site by its capped share (:func:`robust_combiner`). With equal shares each is the
paper's rule (the trimmed mean where β·n is a whole number of sites: medflare cuts β of the share mass). The
guarantees hold while one site's share stays below what the rule tolerates (``RobustConfig`` requires such a cap).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from medflare.errors import ConfigError, PayloadError
from medflare.ops.influence import Shares, cast_like

Params = Mapping[str, np.ndarray]
_TIE = 1e-12  # cumulative shares this close to a boundary count as on it (float sums of shares like 1/7)


def _stacked(updates: np.ndarray) -> np.ndarray:
    stacked = np.asarray(updates, dtype=np.float64)
    if stacked.ndim < 1 or stacked.shape[0] == 0:
        raise ConfigError(f"robust rules take one update per site ([sites, values...]), got {stacked.shape}")
    return stacked


def _sorted_with_weights(stacked: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per coordinate, the sites' values in ascending order and their weights normalised to sum to one."""
    full = np.broadcast_to(_column(weights, stacked.ndim), stacked.shape)
    order = np.argsort(stacked, axis=0, kind="stable")
    ordered_weights = np.take_along_axis(full, order, axis=0)
    total = ordered_weights.sum(axis=0)
    if np.any(total <= 0):
        raise PayloadError("a robust rule needs a positive share in every coordinate")
    return np.take_along_axis(stacked, order, axis=0), ordered_weights / total


def _column(weights: np.ndarray, ndim: int) -> np.ndarray:
    """Per-site weights ``[S]`` or per-site-and-row ``[S, R]``, shaped to broadcast over ``[S, ...]`` arrays."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights.reshape(weights.shape + (1,) * (ndim - weights.ndim))


def weighted_median(updates: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per coordinate, the value where the sites' cumulative weight (``[S]`` or ``[S, R]``) passes one half, or
    the mean of it and the next where it reaches one half exactly (equal weights: the ordinary median)."""
    values, shares = _sorted_with_weights(_stacked(updates), weights)
    cumulative = np.cumsum(shares, axis=0)
    upper = np.argmax(cumulative > 0.5 + _TIE, axis=0)[None]
    lower = np.argmax(cumulative >= 0.5 - _TIE, axis=0)[None]
    at_half = np.take_along_axis(cumulative, lower, axis=0) <= 0.5 + _TIE
    high, low = np.take_along_axis(values, upper, axis=0), np.take_along_axis(values, lower, axis=0)
    return np.where(at_half, (low + high) / 2, high)[0]


def weighted_trimmed_mean(updates: np.ndarray, weights: np.ndarray, cut: float) -> np.ndarray:
    """Per coordinate, the weighted mean of the middle of the sites' share mass, ``cut`` of it removed from each
    end (a site straddling a cut counts with the part inside)."""
    stacked = _stacked(updates)
    if not 0 <= cut < 0.5:
        raise ConfigError(f"trimmed mean: trim_fraction must be in [0, 0.5), got {cut}")
    values, shares = _sorted_with_weights(stacked, weights)
    upper = np.cumsum(shares, axis=0)
    lower = upper - shares
    inside = np.clip(np.minimum(upper, 1 - cut) - np.maximum(lower, cut), 0.0, None)
    inside[inside < _TIE] = 0.0  # float slivers of a cut site (cumulative 1/7 steps) count for nothing
    return (inside * values).sum(axis=0) / inside.sum(axis=0)


def closest_to_median_mean(updates: np.ndarray, weights: np.ndarray, keep: int) -> np.ndarray:
    """Per coordinate, the weighted mean of the ``keep`` values closest to the weighted median (Bulyan's last
    step; with equal weights the plain mean of the β closest values)."""
    stacked = _stacked(updates)
    if not 1 <= keep <= stacked.shape[0]:
        raise ConfigError(f"Bulyan keeps 1 to {stacked.shape[0]} values per coordinate, got {keep}")
    median = weighted_median(stacked, weights)
    closest = np.argsort(np.abs(stacked - median), axis=0, kind="stable")[:keep]
    full = np.broadcast_to(_column(weights, stacked.ndim), stacked.shape)
    values, shares = np.take_along_axis(stacked, closest, axis=0), np.take_along_axis(full, closest, axis=0)
    total = shares.sum(axis=0)
    equal = values.mean(axis=0)  # where every kept value has zero share, they count alike
    return np.where(total > 0, (shares * values).sum(axis=0) / np.where(total > 0, total, 1.0), equal)


def coordinate_median(updates: np.ndarray) -> np.ndarray:
    """Per coordinate, the median over the sites (the mean of the two middle values for an even count)."""
    stacked = _stacked(updates)
    return weighted_median(stacked, np.ones(stacked.shape[0]))


def trimmed_mean(updates: np.ndarray, beta: float) -> np.ndarray:
    """Per coordinate, the mean after removing the ⌊β·n⌋ largest and the ⌊β·n⌋ smallest values (0 ≤ β < 1/2)."""
    stacked = _stacked(updates)
    if not 0 <= beta < 0.5:
        raise ConfigError(f"trimmed mean: trim_fraction must be in [0, 0.5), got {beta}")
    count = stacked.shape[0]
    return weighted_trimmed_mean(stacked, np.ones(count), int(beta * count) / count)


def squared_distances(models: Sequence[Params], keys: Sequence[str] | None = None) -> np.ndarray:
    """``[S, S]`` squared Euclidean distances between the sites' arrays over ``keys`` (default: every key of the
    first), summed key by key in float64 so no site's whole model is ever flattened into one copy."""
    keys = list(models[0]) if keys is None else list(keys)
    count = len(models)
    distances = np.zeros((count, count), dtype=np.float64)
    for key in keys:
        for i in range(count):
            for j in range(i + 1, count):
                diff = np.subtract(models[i][key], models[j][key], dtype=np.float64).ravel()
                distances[i, j] += float(np.dot(diff, diff))
    return distances + distances.T


def krum_scores_of(distances: np.ndarray, f: int, neighbours: int | None = None) -> np.ndarray:
    """Krum scores from squared distances: each site's sum over its n − f − 2 nearest others (or ``neighbours``)."""
    n = distances.shape[0]
    k = n - f - 2 if neighbours is None else neighbours
    if f < 0 or not 1 <= k <= n - 1:
        raise ConfigError(f"Krum needs n - f - 2 >= 1 (n = {n} sites, f = {f} assumed Byzantine)")
    nearest = np.sort(distances + np.diag(np.full(n, np.inf)), axis=1)[:, :k]
    return nearest.sum(axis=1)


def multi_krum_picks(distances: np.ndarray, f: int, m: int) -> list[int]:
    """The ``m`` sites with the lowest Krum scores, lowest first (the first site on a tie)."""
    if not 1 <= m <= distances.shape[0]:
        raise ConfigError(f"Multi-Krum keeps 1 to {distances.shape[0]} updates, got m = {m}")
    return np.argsort(krum_scores_of(distances, f), kind="stable")[:m].tolist()


def bulyan_picks(distances: np.ndarray, f: int) -> list[int]:
    """Bulyan's θ = n − 2f sites, chosen by Krum one at a time from a shrinking pool (n ≥ 4f + 3)."""
    n = distances.shape[0]
    if f < 0 or n < 4 * f + 3:
        raise ConfigError(f"Bulyan needs n >= 4f + 3 (n = {n} sites, f = {f} assumed Byzantine)")
    pool, chosen = list(range(n)), []
    for _ in range(n - 2 * f):
        # the last picks leave fewer than f + 3 in the pool, where Krum's n − f − 2 is < 1: the nearest one counts
        within = distances[np.ix_(pool, pool)]
        scores = krum_scores_of(within, f, max(len(pool) - f - 2, 1)) if len(pool) > 1 else np.zeros(1)
        chosen.append(pool.pop(int(np.argmin(scores))))
    return chosen


def _row_distances(stacked: np.ndarray) -> np.ndarray:
    return squared_distances([{"row": row} for row in stacked])


def krum_scores(updates: np.ndarray, f: int, neighbours: int | None = None) -> np.ndarray:
    """Each site's Krum score over ``[sites, values]`` rows."""
    return krum_scores_of(_row_distances(_stacked(updates)), f, neighbours)


def krum(updates: np.ndarray, f: int) -> np.ndarray:
    """The update with the lowest Krum score (the first one on a tie)."""
    return multi_krum(updates, f, 1)


def multi_krum(updates: np.ndarray, f: int, m: int) -> np.ndarray:
    """The mean of the ``m`` updates with the lowest Krum scores (1 ≤ m ≤ n; m = 1 is Krum)."""
    stacked = _stacked(updates)
    return stacked[multi_krum_picks(_row_distances(stacked), f, m)].mean(axis=0)


def bulyan(updates: np.ndarray, f: int) -> np.ndarray:
    """Bulyan over Krum: θ = n − 2f updates chosen by Krum one at a time, then per coordinate the mean of the
    β = θ − 2f chosen values closest to their median (n ≥ 4f + 3)."""
    stacked = _stacked(updates)
    selected = stacked[bulyan_picks(_row_distances(stacked), f)]
    return closest_to_median_mean(selected, np.ones(len(selected)), len(selected) - 2 * f)


Coordinatewise = Callable[[np.ndarray, np.ndarray], np.ndarray]


def robust_combiner(coordinatewise: Coordinatewise) -> Callable[..., dict[str, np.ndarray]]:
    """A combiner for ``methods.base.aggregate_updates`` that applies ``coordinatewise(stacked, weights)`` to every
    array instead of the weighted sum, with each site's bounded share (its row shares where the method weighs an
    array row by row)."""

    def combine_robustly(updates: Mapping[str, Params], shares: Shares,
                         dtypes: Mapping[str, np.dtype] | None = None) -> dict[str, np.ndarray]:
        if not updates:
            raise PayloadError("nothing to aggregate: no site update was accepted")
        sites = list(updates)
        result: dict[str, np.ndarray] = {}
        for key in updates[sites[0]]:
            stacked = np.stack([np.asarray(updates[site][key], dtype=np.float64) for site in sites])
            if key in shares.rows:
                weights = shares.rows[key][[shares.order.index(site) for site in sites]]
            else:
                weights = np.array([shares.sites[site] for site in sites], dtype=np.float64)
            dtype = dtypes[key] if dtypes and key in dtypes else np.asarray(updates[sites[0]][key]).dtype
            result[key] = cast_like(coordinatewise(stacked, weights), dtype)
        return result

    return combine_robustly
