"""FedBABU server rule: FedAvg (the frozen head averages to itself); FCA's named final figures."""

from __future__ import annotations

from typing import Any, Mapping

from medflare.evaluation import SPECIALIZATION, personalization_figures
from medflare.methods.base import ServerRule

__all__ = ["FedBabuRule"]


class FedBabuRule(ServerRule):
    """Sample-count-weighted average of every shared key.

    Generalization = the global body with the shared random head on the pooled test splits; specialization =
    each site's body with a locally fine-tuned head copy on its own test split, averaged over sites.
    """

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        return personalization_figures(final, global_classifier=True, specialization=SPECIALIZATION)
