"""Fed-MAS server rule: sites weighted by RF/ΣRF (MAS), with the inverse and DRW variants and an optional cap."""

from __future__ import annotations

from typing import Any


from medflare.errors import ConfigError
from medflare.methods.base import RoundContext, ServerRule, SiteUpdate
from medflare.methods.fed_mas.client import RF_KEY


class FedMasRule(ServerRule):
    """θ_glob = Σ_c (RF_c / Σ_j RF_j) θ_c over every state-dict entry (paper Eq. 5).

    ``mas_drw`` (code only, not the paper): sample-count weights until ``drw_start`` of the rounds, then
    effective-number weights of 1/RF, (1 − β)/(1 − β^(1/RF)), which for β → 1 stays close to RF itself.
    ``max_share`` > 0 caps any one site's share and gives the excess to the others (off by default, as in the
    paper). A site with a missing, non-finite or non-positive RF is rejected before it gets here.
    """

    def site_weight(self, update: SiteUpdate, ctx: RoundContext) -> float:
        if self.cfg.aggregation == "samples" or (
            self.cfg.aggregation == "mas_drw" and ctx.round < self.cfg.drw_start * ctx.total_rounds
        ):
            return super().site_weight(update, ctx)
        rf = float(update.meta[RF_KEY])
        if self.cfg.aggregation == "mas_drw":
            beta = self.cfg.drw_beta
            return (1 - beta) / (1 - beta ** (1 / rf))
        return rf

    def shares(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, float]:
        return cap_shares(super().shares(updates, ctx), self.cfg.max_share)

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        rf = {u.site: u.meta[RF_KEY] for u in updates if RF_KEY in u.meta}
        return {"rf": rf} if rf else {}


def cap_shares(shares: dict[str, float], cap: float) -> dict[str, float]:
    """Limit every share to ``cap`` and spread the excess over the others in proportion (water-filling)."""
    if cap <= 0:
        return dict(shares)
    if cap * len(shares) < 1 - 1e-12:
        raise ConfigError(f"max_share={cap} is impossible with {len(shares)} sites: shares must sum to 1")
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
