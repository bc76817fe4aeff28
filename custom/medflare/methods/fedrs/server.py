"""FedRS server rule: FedAvg; FCA's named final figures (its sites keep the global model)."""

from __future__ import annotations

from typing import Any, Mapping

from medflare.evaluation import personalization_figures
from medflare.methods.base import ServerRule

__all__ = ["FedRsRule"]


class FedRsRule(ServerRule):
    """Sample-count-weighted average of every shared key.

    One model serves everyone, so generalization = the global model on the pooled test splits and specialization
    = the same global model on each site's own test split, averaged over sites (``final.site_mean``).
    """

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        return personalization_figures(final, global_classifier=True, specialization=None)
