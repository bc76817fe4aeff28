"""Weighted aggregation of site updates: one function serves FedAvg, RF weights and per-class rows."""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from medflare.errors import PayloadError

Params = Mapping[str, np.ndarray]


def normalise_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Scale non-negative site weights to sum to one.

    Raises:
        PayloadError: when a weight is negative or not finite, or all weights are zero.
    """
    for site, weight in weights.items():
        check_weight(site, weight)
    total = float(sum(weights.values()))
    if total <= 0:
        raise PayloadError(f"aggregation weights sum to {total}; at least one site must have a positive weight")
    return {site: float(weight) / total for site, weight in weights.items()}


def check_weight(site: str, weight: float) -> float:
    """A site's aggregation weight as a float.

    Raises:
        PayloadError: when it is negative or not finite.
    """
    if not math.isfinite(weight) or weight < 0:
        raise PayloadError(f"aggregation weight of {site} must be finite and >= 0, got {weight}")
    return float(weight)


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


class RunningWeightedSum:
    """Σ_i w_i·a_i per key in float64 and the weights w_i, added one site at a time in the order the caller
    adds them; the average divides once by Σ_i w_i at the end.

    The batch path (:func:`weighted_average`) scales each term by its share w_i/Σ_j w_j instead, so the two agree
    to float64 rounding, not bit for bit. Float addition is not associative: the caller fixes the order
    (:class:`SiteOrderedSum`) when the sum must repeat bit for bit.
    """

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.weights: dict[str, float] = {}  # site -> weight, in the order the sites were added

    def add(self, site: str, arrays: Params, weight: float) -> None:
        """Add one site's arrays with its unnormalised weight; the caller may drop them after."""
        weight = check_weight(site, weight)
        for key, array in arrays.items():
            term = np.multiply(array, weight, dtype=np.float64)
            if key in self.sums:
                self.sums[key] += term
            else:
                self.sums[key] = term
        self.weights[site] = weight

    def average(self, dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
        """key -> Σ w_i·a_i / Σ w_i in ``dtypes[key]`` (integers rounded).

        Raises:
            PayloadError: nothing added, or weights that do not sum to a positive number.
        """
        if not self.weights:
            raise PayloadError("nothing to aggregate: no site update was accepted")
        normalise_weights(self.weights)  # the batch path's checks
        total = sum(self.weights.values())
        return {key: _cast_like(values / total, dtypes[key]) for key, values in self.sums.items()}


class SiteOrderedSum:
    """A :class:`RunningWeightedSum` whose additions happen in site-name order whatever order results arrive in,
    so a rerun with the same results gives the same bits however the network timed them.

    An arriving result waits until every expected site that sorts before it has been added or is known to be
    absent (rejected); :meth:`finish` adds whatever still waits, in order (sites that never answered). Until
    :meth:`expect` names the sites a phase was sent to, every result waits for :meth:`finish`. Memory: the
    float64 sum plus the results that arrived before an earlier site's.
    """

    def __init__(self) -> None:
        self.total = RunningWeightedSum()
        self.expected: set[str] | None = None  # sites whose results may arrive; None = not known yet
        self.absent: set[str] = set()  # expected sites known to send nothing that counts
        self.waiting: dict[str, tuple[Params, float]] = {}  # arrived before an earlier site: arrays, weight
        self.out_of_order: list[str] = []  # unexpected sites added after a later one (order lost; should not happen)
        self.most_waiting = 0

    def expect(self, sites: Iterable[str]) -> None:
        """Name the sites this phase was sent to (sites already seen count as sent to)."""
        self.expected = set(sites) | set(self.waiting) | set(self.total.weights)
        self._add_ready()

    def arrive(self, site: str, arrays: Params, weight: float) -> None:
        """Take an accepted site's arrays (keys to aggregate only) and weight: add them now if their turn has
        come, else hold them until it has.

        Raises:
            PayloadError: an invalid weight (nothing is held or added then).
        """
        weight = check_weight(site, weight)
        if self.expected is not None and (site not in self.expected or site in self.absent):
            if any(added > site for added in self.total.weights):  # its turn has passed: add it now, say so
                self.out_of_order.append(site)
                self.total.add(site, arrays, weight)
                return
            self.expected.add(site)
            self.absent.discard(site)
        self.waiting[site] = (arrays, weight)
        self._add_ready()
        self.most_waiting = max(self.most_waiting, len(self.waiting))

    def mark_absent(self, site: str) -> None:
        """A site whose result will not count (rejected): later sites need not wait for it."""
        if site not in self.waiting and site not in self.total.weights:
            self.absent.add(site)
            self._add_ready()

    def finish(self) -> RunningWeightedSum:
        """Add every result still waiting, in site order, and return the sum."""
        for site in sorted(self.waiting):
            self.total.add(site, *self.waiting.pop(site))
        return self.total

    def _add_ready(self) -> None:
        if self.expected is None:
            return
        pending = sorted(self.expected - self.absent - set(self.total.weights))
        for site in pending:
            if site not in self.waiting:
                return  # an earlier site may still arrive
            self.total.add(site, *self.waiting.pop(site))


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
