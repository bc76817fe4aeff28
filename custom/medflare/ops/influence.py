"""The one place that bounds every site's influence on every aggregate.

A server rule only returns raw per-site weights: a :class:`Weighting` for the next global model (a scalar per
site, and per-row weights for arrays weighed row by row: FedLSM's q, FedAvg*'s masks) or a :class:`Mixture` for
arrays built for each site from the sites' arrays (MDH-FL's teacher mix). Here they become shares: finite,
non-negative, summing to one per part, and with the job's ``robust.max_share`` no site's share of any part (scalar,
every row, every receiver's mix) above it; a cap this round's sites cannot meet relaxes to equal shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from medflare.errors import PayloadError

Params = Mapping[str, np.ndarray]
_SLACK = 1e-12  # a share this far above the cap counts as at the cap (float sums of shares)


@dataclass(frozen=True)
class Weighting:
    """Raw per-site weights for the next global model: ``sites`` (scalar, e.g. n_k or RF), ``rows`` (key -> site
    -> weights over the array's first axis; a row weighing zero in all falls back to the scalar shares) and the
    rule's own ``cap`` (0 = none; the tighter of it and the job's applies)."""

    sites: Mapping[str, float]
    rows: Mapping[str, Mapping[str, np.ndarray]] = field(default_factory=dict)
    cap: float = 0.0


@dataclass(frozen=True)
class Shares:
    """What each site really weighs after the bounds: ``sites`` (scalar shares, sum 1) and ``rows`` (key -> ``[S, R]``
    shares, sites in ``order``, columns summing to 1)."""

    sites: dict[str, float]
    rows: dict[str, np.ndarray]
    order: tuple[str, ...]

    def largest(self) -> dict[str, float]:
        """site -> its largest share of any part of the aggregate (the scalar share or any row of any array)."""
        largest = dict(self.sites)
        for matrix in self.rows.values():
            for index, site in enumerate(self.order):
                if matrix.shape[1]:
                    largest[site] = max(largest[site], float(matrix[index].max()))
        return largest


@dataclass(frozen=True)
class Mixture:
    """Arrays built for each receiving site under ``key``: receiver p gets ``Σ_i w_p,i · sources[i]`` (its total
    weight is kept, e.g. MDH-FL's row sum s_p; each source's share is bounded; no weights: no array), clipped to
    [low, high] and cast to the receiver's own source dtype (else the first source's)."""

    key: str
    sources: Mapping[str, np.ndarray]
    weights: Mapping[str, Mapping[str, float]]
    low: float | None = None
    high: float | None = None


def check_weight(site: str, weight: float) -> float:
    """A site's aggregation weight as a float; PayloadError when it is negative or not finite."""
    weight = float(weight)
    if not np.isfinite(weight) or weight < 0:
        raise PayloadError(f"aggregation weight of {site} must be finite and >= 0, got {weight}")
    return weight


def normalise_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Scale site weights to sum to one; PayloadError for a negative or non-finite weight, or all zero."""
    checked = {site: check_weight(site, weight) for site, weight in weights.items()}
    total = float(sum(checked.values()))
    if not total > 0 or not np.isfinite(total):
        raise PayloadError(f"aggregation weights sum to {total}; at least one site must have a positive weight")
    return {site: weight / total for site, weight in checked.items()}


def cap_vector(shares: np.ndarray, cap: float) -> np.ndarray:
    """Shares (summing to 1) with none above ``cap`` (at least 1/len), the excess going to the others in
    proportion (water-filling), or equally when every uncapped share is zero."""
    result = np.asarray(shares, dtype=np.float64).copy()
    if cap <= 0 or result.size == 0:
        return result
    cap = max(cap, 1.0 / result.size)
    capped = np.zeros(result.size, dtype=bool)
    while True:
        over = (result > cap + _SLACK) & ~capped
        if not over.any():
            return result
        capped |= over
        result[capped] = cap
        free = ~capped
        excess = 1.0 - cap * capped.sum() - result[free].sum()
        base = result[free].sum()
        result[free] += excess * (result[free] / base if base > 0 else 1.0 / free.sum())


def cap_shares(shares: Mapping[str, float], cap: float) -> dict[str, float]:
    """:func:`cap_vector` on site -> share."""
    sites = list(shares)
    capped = cap_vector(np.array([shares[site] for site in sites], dtype=np.float64), cap)
    return dict(zip(sites, capped.tolist()))


def bound(weighting: Weighting, cap: float = 0.0) -> Shares:
    """The shares a :class:`Weighting` gives, with no site above ``cap`` (or the rule's tighter cap) in any part;
    PayloadError for a bad weight or no positive scalar weight."""
    cap = _tighter(cap, weighting.cap)
    order = tuple(weighting.sites)
    scalar = cap_shares(normalise_weights(weighting.sites), cap)
    fallback = np.array([scalar[site] for site in order], dtype=np.float64)
    rows = {key: _row_shares(key, per_site, order, fallback, cap) for key, per_site in weighting.rows.items()}
    return Shares(sites=scalar, rows=rows, order=order)


def combine(updates: Mapping[str, Params], shares: Shares, dtypes: Mapping[str, np.dtype] | None = None) -> dict:
    """key -> Σ_site share·array for every array the sites sent (row-wise where ``shares.rows`` says so), in
    ``dtypes`` (default: the first site's; integers rounded and clipped, so no average wraps around)."""
    if not updates:
        raise PayloadError("nothing to aggregate: no site update was accepted")
    sites = list(updates)
    result: dict[str, np.ndarray] = {}
    for key in updates[sites[0]]:
        arrays = [updates[site][key] for site in sites]
        if key in shares.rows:
            matrix = shares.rows[key][[shares.order.index(site) for site in sites]]
            averaged = _row_weighted_sum(arrays, matrix)
        else:
            averaged = weighted_sum(arrays, [shares.sites[site] for site in sites])
        dtype = dtypes[key] if dtypes and key in dtypes else np.asarray(arrays[0]).dtype
        result[key] = cast_like(averaged, dtype)
    return result


def mix(mixture: Mixture, cap: float = 0.0) -> dict[str, dict[str, np.ndarray]]:
    """receiver -> {key: its mixed array}, each source's share capped at ``cap``; PayloadError for a bad weight
    or a source that sent nothing."""
    result: dict[str, dict[str, np.ndarray]] = {}
    for receiver, weights in mixture.weights.items():
        total = sum(check_weight(site, w) for site, w in weights.items())
        if not weights or total <= 0:
            result[receiver] = {}
            continue
        missing = sorted(set(weights) - set(mixture.sources))
        if missing:
            raise PayloadError(f"cannot mix '{mixture.key}' for {receiver}: no array from {missing}")
        shares = cap_shares(normalise_weights(weights), cap)
        mixed = total * weighted_sum([mixture.sources[s] for s in shares], list(shares.values()))
        if mixture.low is not None or mixture.high is not None:
            mixed = np.clip(mixed, mixture.low, mixture.high)
        own = mixture.sources.get(receiver, next(iter(mixture.sources.values())))
        result[receiver] = {mixture.key: mixed.astype(np.asarray(own).dtype)}
    return result


def weighted_sum(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Σ_i w_i·a_i, each product in float64, one term at a time (a stack of every site's float64 copy was also
    ten times slower for a ResNet-18 and two sites)."""
    total = np.multiply(arrays[0], weights[0], dtype=np.float64)
    term = np.empty_like(total)
    for array, weight in zip(arrays[1:], weights[1:]):
        np.multiply(array, weight, out=term, dtype=np.float64)
        total += term
    return total


def cast_like(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` in ``dtype``; integers rounded and clipped to the dtype's range first (no wrap-around)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iub":
        info = np.iinfo(dtype) if dtype.kind in "iu" else None
        rounded = np.rint(values)
        if info is not None:  # float64 holds 2**63 - 1 as 2**63: clip below it so the cast cannot overflow
            rounded = np.clip(rounded, float(info.min), np.nextafter(float(info.max), 0.0))
        return rounded.astype(dtype)
    return values.astype(dtype)


def _tighter(cap: float, other: float) -> float:
    caps = [c for c in (cap, other) if c > 0]
    return min(caps) if caps else 0.0


def _row_shares(
    key: str, per_site: Mapping[str, np.ndarray], order: tuple[str, ...], fallback: np.ndarray, cap: float
) -> np.ndarray:
    """``[S, R]`` shares of each row of ``key``: raw row weights normalised per row (the scalar shares where a row
    has no weight at all), then every row capped like the scalar shares."""
    raw = np.stack([np.asarray(per_site[site], dtype=np.float64).ravel() for site in order])
    if not np.all(np.isfinite(raw)) or np.any(raw < 0):
        raise PayloadError(f"row weights of '{key}' must be finite and >= 0")
    totals = raw.sum(axis=0)
    if not np.all(np.isfinite(totals)):
        raise PayloadError(f"row weights of '{key}' overflow when summed over sites")
    safe = np.where(totals > 0, totals, 1.0)
    shares = np.where(totals > 0, raw / safe, fallback[:, None])
    if cap > 0:
        shares = np.stack([cap_vector(column, cap) for column in shares.T], axis=1) if shares.size else shares
    return shares


def _row_weighted_sum(arrays: Sequence[np.ndarray], matrix: np.ndarray) -> np.ndarray:
    """Σ_site matrix[site, r]·array[site][r, ...] for every row r, in float64."""
    first = np.asarray(arrays[0])
    if matrix.shape[1] != first.shape[0]:
        raise PayloadError(f"row weights have {matrix.shape[1]} rows, the array has {first.shape[0]}")
    total = np.zeros(first.shape, dtype=np.float64)
    for array, share in zip(arrays, matrix):
        total += np.asarray(array, dtype=np.float64) * share.reshape(share.shape + (1,) * (first.ndim - 1))
    return total
