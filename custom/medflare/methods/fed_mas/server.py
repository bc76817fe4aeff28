"""Fed-MAS server rule: sites weighted by RF/ΣRF (MAS), with the inverse and DRW variants and an optional cap."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from medflare.losses import inverse_effective_number
from medflare.methods.base import RoundContext, ServerRule, SiteUpdate
from medflare.methods.fed_mas.client import RF_KEY
from medflare.ops.influence import Weighting


class FedMasRule(ServerRule):
    """θ_glob = Σ_c (RF_c / Σ_j RF_j) θ_c over every state-dict entry (paper Eq. 5). ``mas_drw`` (the authors' code, not
    the paper) follows their server: n_c before round ⌊``drw_start`` · R⌋, then :func:`mas_drw_weights`. ``max_share`` >
    0 caps any one site's share and gives the excess to the others (off by default, as in the paper); a cap this round's
    sites cannot meet (e.g. 0.3 after one of four sites was rejected) relaxes to equal shares. A site with a missing,
    non-finite or non-positive RF is rejected earlier."""

    def site_weight(self, update: SiteUpdate, ctx: RoundContext) -> float:
        if self.cfg.aggregation == "samples":
            return super().site_weight(update, ctx)
        rf = float(update.meta[RF_KEY])  # every RF-based rule needs it: a site without one is rejected
        if self.cfg.aggregation == "mas_drw":
            return super().site_weight(update, ctx)  # n_c; the RF factor needs all sites, see shares()
        return rf

    def streams(self, ctx: RoundContext) -> bool:
        """RF and sample-count weights are each site's own; the DRW factors and a cap need every site at once."""
        return self.cfg.aggregation in ("mas", "mas_inv", "samples") and self.cfg.max_share <= 0

    def site_weights(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, float]:
        if self.cfg.aggregation == "mas_drw" and drw_is_on(ctx, self.cfg.drw_start):
            sample_counts = {u.site: self.site_weight(u, ctx) for u in updates}
            rescue_factors = {u.site: float(u.meta[RF_KEY]) for u in updates}
            return mas_drw_weights(sample_counts, rescue_factors, self.cfg.drw_beta)
        return super().site_weights(updates, ctx)

    def weighting(self, updates: list[SiteUpdate], ctx: RoundContext) -> Weighting:
        """The raw weights with the method's own ``max_share`` option as the rule's cap (the server applies the
        tighter of it and the job's)."""
        return replace(super().weighting(updates, ctx), cap=self.cfg.max_share)

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        rf = {u.site: u.meta[RF_KEY] for u in updates if RF_KEY in u.meta}
        return {"rf": rf} if rf else {}


def drw_is_on(ctx: RoundContext, start_fraction: float) -> bool:
    """True from round ⌊f · R⌋ (0-based) on, the authors' ``round >= int(0.8 · comm_round)``; the tiny slack keeps
    a product such as 0.29 · 100 = 28.999999999999996 from flooring one round early."""
    return ctx.round >= math.floor(start_fraction * ctx.total_rounds + 1e-9)


def mas_drw_weights(sample_counts: dict[str, float], rescue_factors: dict[str, float], beta: float) -> dict[str, float]:
    """The authors' deferred re-weighting of sites (site -> unnormalised weight): n_c · (1 − β)/(1 − β^ñ_c) with ñ_c =
    (1/RF_c) / Σ_j (1/RF_j), the site's share of the inverse rescue factors, in (0, 1]; for β → 1 the factor tends to
    1/ñ_c ∝ RF_c, so the weight approaches n_c · RF_c. (The authors also rescale the factors to sum to the number of
    sites; that cancels when the weights are normalised.)"""
    sites = list(sample_counts)
    inverse_rf = np.array([1.0 / rescue_factors[s] for s in sites])
    factors = inverse_effective_number(inverse_rf / inverse_rf.sum(), beta)
    return {site: float(sample_counts[site] * factor) for site, factor in zip(sites, factors)}
