"""FedAvg*'s server: FedAvg by labelled-sample count, classifier row c over the sites annotating c (by n_k)."""

from __future__ import annotations

import numpy as np

from medflare.errors import PayloadError
from medflare.methods.base import RoundContext, ServerRule, SiteUpdate
from medflare.methods.fedlsm.server import CLASSIFIER_KEYS, IDENTIFIED_KEY, classifier_row_weights, masked_vectors


class MaskedClassifierRule(ServerRule):
    """θ ← Σ_k (n_k/n) θ_k; classifier row c ← Σ_k n_k·1[c ∈ I_k] ψ_{k,c} / Σ_j n_j·1[c ∈ I_j]. Spec §5(e)8, inferred
    from FedLSM's ablation (FPSL's code was not found). A class no site annotates falls back to n_k."""

    def site_weight(self, update: SiteUpdate, ctx: RoundContext) -> float:
        if IDENTIFIED_KEY not in update.meta:
            raise PayloadError(f"masked aggregation needs '{IDENTIFIED_KEY}' in every update")
        return super().site_weight(update, ctx)

    def row_weights(self, updates: list[SiteUpdate]) -> dict[str, dict[str, np.ndarray]] | None:
        return classifier_row_weights(updates, CLASSIFIER_KEYS, masked_vectors(updates))
