"""FedRep server rule: FedAvg of the body (heads never arrive); FCA's named final figures."""

from __future__ import annotations

from typing import Any, Mapping

from medflare.evaluation import GENERALIZATION, SPECIALIZATION, personalization_figures
from medflare.methods.base import ServerRule

__all__ = ["FedRepRule"]


class FedRepRule(ServerRule):
    """Sample-count-weighted average of the body. FedRep has no global classifier: the server never holds a head
    (``final.test`` pools each site's own model on its own test split). Generalization = each site's body and personal
    head on the pooled test set, averaged over sites (FCA's "personalized classifier [...] on the generalized test set";
    simulation only); specialization = the same model on the site's own test split, averaged over sites."""

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        return personalization_figures(final, global_classifier=False, specialization=SPECIALIZATION,
                                       generalization=GENERALIZATION)
