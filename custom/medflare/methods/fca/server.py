"""FCA server rule: FedAvg of the shared keys (the personal heads never arrive); FCA's named final figures."""

from __future__ import annotations

from typing import Any, Mapping

from medflare.evaluation import SPECIALIZATION, personalization_figures
from medflare.methods.base import ServerRule

__all__ = ["FcaRule"]


class FcaRule(ServerRule):
    """Sample-count-weighted average of the extractor and the federated head (paper Eq. 6).

    Final figures: generalization = the global model (federated head) on the pooled test splits; specialization =
    each site's extractor and personal head on its own test split, averaged over sites.
    """

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        return personalization_figures(final, global_classifier=True, specialization=SPECIALIZATION)
