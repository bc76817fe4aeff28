"""The server side of the exchange: it holds no model, checks the sites' public sets, and builds each site's T_p
(pure numpy, driven by the generic controller through the ServerRule hooks)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from medflare import contracts
from medflare.errors import ConfigError, DataError
from medflare.methods.base import PerSite, RoundContext, ServerRule, SiteUpdate
from medflare.methods.mdhfl.protocol import (
    DISTILL_PHASE,
    PRIVATE_LOSS,
    PROBS,
    PROBS_PHASE,
    PUBLIC_DIGEST,
    PUBLIC_ROWS,
    PUBLIC_SIZE,
    SETUP_PHASE,
)
from medflare.methods.mdhfl.targets import ccr_weights, mean_weights, target_mixture
from medflare.ops.influence import Mixture


class PublicSetMismatch(DataError):
    """Sites hold different copies of the public set: the exchange would compare predictions on other images."""


def chunk_bounds(round_index: int, chunk: int, public_size: int, per_round: int, chunks: int) -> tuple[int, int]:
    """(first row, row count) of a chunk: round r uses ``per_round`` rows from row r·per_round on (wrapping
    around the public set), split into ``chunks`` consecutive parts of near-equal size."""
    start = (round_index * per_round) % public_size
    low, high = chunk * per_round // chunks, (chunk + 1) * per_round // chunks
    return (start + low) % public_size, high - low


def check_public_digests(setup: list[SiteUpdate]) -> tuple[str, int]:
    """The public set every site must hold: the digest most sites report, and its size; PublicSetMismatch names
    every site whose copy differs."""
    digests = {u.site: (u.meta[PUBLIC_DIGEST], int(u.meta[PUBLIC_SIZE])) for u in setup}
    reference, _ = Counter(digests.values()).most_common(1)[0]  # ties: the first site's copy, by name
    odd = sorted(site for site, copy in digests.items() if copy != reference)
    if odd:
        holders = sorted(site for site, copy in digests.items() if copy == reference)
        details = "; ".join(f"{s}: {digests[s][1]} images, sha256 {digests[s][0][:12]}…" for s in odd)
        raise PublicSetMismatch(f"public set mismatch: {', '.join(odd)} hold(s) a different copy of the public set "
                                f"({details}) than {', '.join(holders)} ({reference[1]} images, sha256 "
                                f"{reference[0][:12]}…); every site must read the same public images in the same "
                                f"order: fix data.public_source at {', '.join(odd)}")
    return reference


class MdhflRule(ServerRule):
    """Runs the exchange's phases and builds T_p per site; aggregates nothing (no weights travel). Keeps across
    rounds the public set's size, which sites were checked, and each site's latest private loss (for CCR)."""

    encrypted_aggregation_refusal = ("it sends no weights: the server mixes the sites' public-set predictions per "
                                     "receiver and clips them, which it must read to do")

    def __init__(self, method_cfg: Any, total_rounds: int, payload: contracts.Payload = contracts.Payload()) -> None:
        super().__init__(method_cfg, total_rounds, payload)
        self.public_size = 0
        self.checked: set[str] = set()  # sites whose public-set digest matched at set-up
        self.previous_loss: dict[str, float] = {}  # latest private loss of each site before this round
        self.current_loss: dict[str, float] = {}  # this round's
        self._round, self._chunk, self._rows = -1, -1, (0, 0)
        self._info: dict[str, Any] = {}

    def phases(self, ctx: RoundContext) -> list[str]:
        if not self.cfg.distill:
            return [contracts.TRAIN_PHASE]
        exchange = [PROBS_PHASE, DISTILL_PHASE] * (self.cfg.chunks - 1) + [PROBS_PHASE, contracts.TRAIN_PHASE]
        return ([SETUP_PHASE] if ctx.round == 0 else []) + exchange

    def array_dims(self, phase: str, ctx: RoundContext) -> dict[str, int]:
        return {"rows": self._rows[1]} if phase == PROBS_PHASE else {}

    def phase_arrays(self, phase: str, ctx: RoundContext, global_params: Mapping[str, np.ndarray],
                     earlier: Mapping[str, list[SiteUpdate]]) -> dict[str, np.ndarray] | PerSite | Mixture:
        if phase == SETUP_PHASE or not self.cfg.distill:
            return {}
        if phase == PROBS_PHASE:
            self._next_chunk(ctx, earlier)
            return {PUBLIC_ROWS: np.asarray(self._rows, dtype=np.int64)}
        probs = [u for u in earlier.get(PROBS_PHASE, []) if u.site in self.checked]
        if self._chunk == 0:
            self.current_loss = {u.site: float(u.meta[PRIVATE_LOSS]) for u in probs if PRIVATE_LOSS in u.meta}
        mixture = self._targets(probs)
        if phase == DISTILL_PHASE:
            return replace(mixture, weights={site: w for site, w in mixture.weights.items() if w})
        everyone = self.checked | {u.site for u in earlier.get(PROBS_PHASE, [])}
        return replace(mixture, weights={site: mixture.weights.get(site, {}) for site in sorted(everyone)})

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        return dict(self._info)

    # ----- internals ------------------------------------------------------------------------------
    def _next_chunk(self, ctx: RoundContext, earlier: Mapping[str, list[SiteUpdate]]) -> None:
        """Advance to the next chunk of public rows (the first of a new round resets the counters)."""
        if ctx.round != self._round:
            if SETUP_PHASE in earlier:
                self._set_up(earlier[SETUP_PHASE])
            if not self.public_size:
                raise ConfigError("no site reported its public set at set-up; the exchange cannot start")
            self.previous_loss.update(self.current_loss)
            self.current_loss = {}
            self._round, self._chunk = ctx.round, 0
            self._info = {"public_rows": [], "weights": [], "targets_for": []}
        else:
            self._chunk += 1
        per_round = min(self.cfg.public_per_round or self.public_size, self.public_size)
        self._rows = chunk_bounds(ctx.round, self._chunk, self.public_size, per_round, self.cfg.chunks)
        self._info["public_rows"].append(list(self._rows))

    def _set_up(self, setup: list[SiteUpdate]) -> None:
        _, self.public_size = check_public_digests(setup)
        self.checked = {u.site for u in setup}
        per_round = min(self.cfg.public_per_round or self.public_size, self.public_size)
        if per_round < 2 * self.cfg.chunks:
            raise ConfigError(f"method.chunks={self.cfg.chunks} splits {per_round} public rows per round into chunks "
                              "of fewer than 2 images; lower chunks or use more public images (data.public_fraction, "
                              "method.public_per_round)")

    def _targets(self, probs: list[SiteUpdate]) -> Mixture:
        """Every site's T_p as a :class:`Mixture` of the probabilities that arrived: the server bounds each teacher's
        share (the job's share cap) and builds T_p in the dtype the site sent."""
        sites = [u.site for u in probs]
        if self.cfg.weighting == "ccr":
            weights = ccr_weights(sites, self.previous_loss, self.current_loss, self.cfg.ccr_beta, self.cfg.ccr_eps)
        else:
            weights = mean_weights(sites, self.cfg.include_self)
        mixture = target_mixture({u.site: u.arrays[PROBS] for u in probs}, weights, self.cfg.include_self)
        self._info["weights"].append(weights)
        self._info["targets_for"].append(sorted(site for site, w in mixture.weights.items() if w))
        return mixture
