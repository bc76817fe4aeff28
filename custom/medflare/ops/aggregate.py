"""Weighted aggregation of site updates: the batch average, and the running sum that streamed aggregation adds to.

The shares themselves are bounded in :mod:`medflare.ops.influence`."""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from medflare.errors import PayloadError
from medflare.ops.influence import (  # noqa: F401  (cap_shares, normalise_weights, weighted_sum: re-exported)
    Weighting,
    bound,
    cap_shares,
    cast_like,
    check_weight,
    combine,
    normalise_weights,
    weighted_sum,
)

Params = Mapping[str, np.ndarray]


def weighted_average(
    updates: Mapping[str, Params],
    weights: Mapping[str, float],
    *,
    row_weights: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    dtypes: Mapping[str, np.dtype] | None = None,
    cap: float = 0.0,
) -> dict[str, np.ndarray]:
    """Average every array over sites: :func:`~medflare.ops.influence.bound`, then
    :func:`~medflare.ops.influence.combine`.

    Args:
        updates: site -> {key: array}; all sites must carry the same keys and shapes.
        weights: site -> non-negative scalar weight (normalised here), e.g. sample count or RF.
        row_weights: optional key -> site -> length-R vector of non-negative weights for the first axis of
            that key (row-wise aggregation of a classifier, FedLSM). A row whose weights sum to zero across
            sites falls back to the scalar weights, so no row is ever divided by zero.
        dtypes: key -> dtype of the result (the global model's), so half-precision transfers are averaged
            in float64 and stored at full precision; default: the first site's dtype.
        cap: no site's share of any array or row above this (0 = no cap).

    Returns:
        key -> aggregated array. Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are averaged and
        rounded back to integers.
    """
    if not updates:
        raise PayloadError("nothing to aggregate: no site update was accepted")
    shares = bound(Weighting({site: weights[site] for site in updates}, row_weights or {}), cap)
    return combine(updates, shares, dtypes)


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
        return {key: cast_like(values / total, dtypes[key]) for key, values in self.sums.items()}


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
