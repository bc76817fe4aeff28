"""Weighted aggregation of site updates: one function serves FedAvg, RF weights and per-class rows."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from medflare.errors import PayloadError

Params = Mapping[str, np.ndarray]


def normalise_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Scale non-negative site weights to sum to one.

    Raises:
        PayloadError: when a weight is negative or not finite, or all weights are zero.
    """
    for site, weight in weights.items():
        if not math.isfinite(weight) or weight < 0:
            raise PayloadError(f"aggregation weight of {site} must be finite and >= 0, got {weight}")
    total = float(sum(weights.values()))
    if total <= 0:
        raise PayloadError(f"aggregation weights sum to {total}; at least one site must have a positive weight")
    return {site: float(weight) / total for site, weight in weights.items()}


def weighted_average(
    updates: Mapping[str, Params],
    weights: Mapping[str, float],
    *,
    row_weights: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    dtypes: Mapping[str, np.dtype] | None = None,
) -> dict[str, np.ndarray]:
    """Average every array over sites.

    Args:
        updates: site -> {key: array}; all sites must carry the same keys and shapes.
        weights: site -> non-negative scalar weight (normalised here), e.g. sample count or RF.
        row_weights: optional key -> site -> length-R vector of non-negative weights for the first axis of
            that key (row-wise aggregation of a classifier, FedLSM). A row whose weights sum to zero across
            sites falls back to the scalar weights, so no row is ever divided by zero.
        dtypes: key -> dtype of the result (the global model's), so half-precision transfers are averaged
            in float64 and stored at full precision; default: the first site's dtype.

    Returns:
        key -> aggregated array. Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are averaged and
        rounded back to integers.
    """
    if not updates:
        raise PayloadError("nothing to aggregate: no site update was accepted")
    shares = normalise_weights({site: weights[site] for site in updates})
    sites = list(updates)
    result: dict[str, np.ndarray] = {}
    site_weights = np.array([shares[site] for site in sites])
    for key in updates[sites[0]]:
        arrays = [updates[site][key] for site in sites]
        if row_weights and key in row_weights:
            stacked = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
            averaged = _row_weighted(stacked, site_weights, [row_weights[key][site] for site in sites])
        else:
            averaged = weighted_sum(arrays, site_weights)
        dtype = dtypes[key] if dtypes and key in dtypes else np.asarray(updates[sites[0]][key]).dtype
        result[key] = _cast_like(averaged, dtype)
    return result


def weighted_sum(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Σ_i w_i·a_i in float64, one term at a time.

    Each product is taken in float64 (a float16 or float32 input is never multiplied at its own precision),
    and at most the sum and one term exist in float64: no stack of every site's float64 copy, which for a
    ResNet-18 and two sites was also ten times slower than this loop.
    """
    total = np.multiply(arrays[0], weights[0], dtype=np.float64)
    term = np.empty_like(total)
    for array, weight in zip(arrays[1:], weights[1:]):
        np.multiply(array, weight, out=term, dtype=np.float64)
        total += term
    return total


def _row_weighted(stacked: np.ndarray, site_weights: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    row_matrix = np.stack([np.asarray(r, dtype=np.float64) for r in rows])  # [S, R]
    if row_matrix.shape[1] != stacked.shape[1]:
        raise PayloadError(f"row weights have {row_matrix.shape[1]} rows, array has {stacked.shape[1]}")
    totals = row_matrix.sum(axis=0)
    fallback = np.repeat(site_weights[:, None], row_matrix.shape[1], axis=1)
    share = np.where(totals > 0, row_matrix / np.where(totals > 0, totals, 1.0), fallback)  # [S, R]
    share = share.reshape(share.shape + (1,) * (stacked.ndim - 2))
    return (share * stacked).sum(axis=0)


def _cast_like(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if np.dtype(dtype).kind in "iub":
        return np.rint(values).astype(dtype)
    return values.astype(dtype)


def cap_shares(shares: Mapping[str, float], cap: float) -> dict[str, float]:
    """Limit every share to ``cap`` and spread the excess over the others in proportion (water-filling).

    A cap that no split of this round's sites can meet (``cap`` < 1/sites, e.g. after a site was rejected)
    relaxes to equal shares instead of stopping the round.
    """
    if cap <= 0 or not shares:
        return dict(shares)
    cap = max(cap, 1.0 / len(shares))
    result = dict(shares)
    capped: set[str] = set()
    while True:
        over = {s for s, v in result.items() if v > cap + 1e-12 and s not in capped}
        if not over:
            return result
        capped |= over
        free = [s for s in result if s not in capped]
        excess = 1 - cap * len(capped) - sum(result[s] for s in free)
        base = sum(result[s] for s in free)
        for site in capped:
            result[site] = cap
        for site in free:
            result[site] += excess * (result[site] / base if base > 0 else 1 / len(free))
