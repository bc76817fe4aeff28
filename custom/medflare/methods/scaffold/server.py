"""SCAFFOLD's server rule (Karimireddy et al. 2020, Algorithm 1, server side): x ← x + η_g avg Δy with η_g = 1, which
is the usual bounded weighted average of the sites' weights y; c ← c + (|S|/N) avg Δc_i, averaged under the same
bounded shares (no site above ``robust.max_share``), never a raw mean. Pure numpy."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from medflare import contracts
from medflare.methods.base import PerSite, RoundContext, ServerRule, SiteUpdate
from medflare.methods.scaffold.control import CONTROL_DIM, DELTA_CONTROL, SERVER_CONTROL, control_keys, control_size
from medflare.ops.influence import bound

CONTROL_INFO = "control_norm"  # a round's record: ‖c‖ after the round's update


class ScaffoldRule(ServerRule):
    """FedAvg's bounded, sample-count-weighted average of the weights, and the server's control variate c: zero at the
    start, sent with every train task, updated from the accepted sites' Δc_i once the round's sites are known. N is
    the number of sites that have sent an accepted result so far in this job (every registered site gets every round's
    task, so |S|/N < 1 only in a round some site missed)."""

    # Δc_i = (x − y_i)/(K η_l) − c travels in plaintext beside the encrypted weights and gives y_i away
    encrypted_aggregation_refusal = ("its Δc_i = (x − y_i)/(K η_l) − c travels in plaintext beside the weights and "
                                     "gives each site's update away, which encrypted aggregation is there to hide")

    def __init__(self, method_cfg: Any, total_rounds: int, payload: contracts.Payload = contracts.Payload()) -> None:
        super().__init__(method_cfg, total_rounds, payload)
        self.control: np.ndarray | None = None  # c (float64), laid out by control.py over the global model
        self.sites_seen: set[str] = set()  # N: the sites with an accepted train result so far

    def phase_arrays(self, phase: str, ctx: RoundContext, global_params: Mapping[str, np.ndarray],
                     earlier: Mapping[str, list[SiteUpdate]]) -> dict[str, np.ndarray] | PerSite:
        arrays = super().phase_arrays(phase, ctx, global_params, earlier)
        if phase != contracts.TRAIN_PHASE:
            return arrays
        size = control_size(global_params, control_keys(global_params, self.payload))
        if self.control is None or self.control.shape != (size,):
            self.control = np.zeros(size, np.float64)
        return {**arrays, SERVER_CONTROL: self.control.astype(np.float32)}

    def array_dims(self, phase: str, ctx: RoundContext) -> dict[str, int]:
        return {CONTROL_DIM: 0 if self.control is None else int(self.control.size)}

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        """c ← c + (|S|/N) Σ_i s_i Δc_i, s_i being each accepted site's bounded share of this round's aggregate."""
        if not updates or self.control is None:
            return {}
        self.sites_seen.update(update.site for update in updates)
        shares = bound(self.weighting(updates, ctx), self.share_cap).sites
        mean_delta = sum(shares[u.site] * np.asarray(u.arrays[DELTA_CONTROL], np.float64) for u in updates)
        self.control = self.control + len(updates) / len(self.sites_seen) * mean_delta
        return {CONTROL_INFO: float(np.linalg.norm(self.control))}

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """c and N's sites, so a job resumed from the round checkpoint corrects with the c it had, not with 0."""
        if self.control is None:
            return {}, {}
        return {"sites_seen": sorted(self.sites_seen)}, {SERVER_CONTROL: self.control}

    def restore(self, facts: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        control = np.asarray(arrays.get(SERVER_CONTROL, np.zeros(0)), np.float64)
        if control.ndim != 1 or not np.all(np.isfinite(control)) or not isinstance(facts.get("sites_seen"), list):
            raise ValueError("the checkpoint's SCAFFOLD control variate c is unusable (not one finite vector, or "
                             "without its sites)")
        self.control, self.sites_seen = control, {str(site) for site in facts["sites_seen"]}
