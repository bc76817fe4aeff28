"""Weighted aggregation of site updates: one function serves FedAvg, RF weights and per-class rows."""

from __future__ import annotations

import math
from typing import Mapping

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
) -> dict[str, np.ndarray]:
    """Average every array over sites.

    Args:
        updates: site -> {key: array}; all sites must carry the same keys and shapes.
        weights: site -> non-negative scalar weight (normalised here), e.g. sample count or RF.
        row_weights: optional key -> site -> length-R vector of non-negative weights for the first axis of
            that key (row-wise aggregation of a classifier, FedLSM). A row whose weights sum to zero across
            sites falls back to the scalar weights, so no row is ever divided by zero.

    Returns:
        key -> aggregated array with the input dtype. Integer buffers (e.g. BatchNorm's
        ``num_batches_tracked``) are averaged and rounded back to integers.
    """
    if not updates:
        raise PayloadError("nothing to aggregate: no site update was accepted")
    shares = normalise_weights({site: weights[site] for site in updates})
    sites = list(updates)
    result: dict[str, np.ndarray] = {}
    for key in updates[sites[0]]:
        stacked = np.stack([np.asarray(updates[site][key], dtype=np.float64) for site in sites])
        site_weights = np.array([shares[site] for site in sites])
        if row_weights and key in row_weights:
            averaged = _row_weighted(stacked, site_weights, [row_weights[key][site] for site in sites])
        else:
            averaged = np.tensordot(site_weights, stacked, axes=1)
        result[key] = _cast_like(averaged, np.asarray(updates[sites[0]][key]).dtype)
    return result


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
