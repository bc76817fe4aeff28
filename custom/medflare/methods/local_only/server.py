"""Local-only server rule: nothing to aggregate; FCA's named final figures."""

from __future__ import annotations

from typing import Any, Mapping

from medflare.evaluation import GENERALIZATION, personalization_figures
from medflare.methods.base import ServerRule

__all__ = ["LocalOnlyRule"]


class LocalOnlyRule(ServerRule):
    """No weights arrive. Each site's evaluation scores its own model on its own test split, so that is the
    specialization (``final.site_mean``). There is no global classifier: generalization = each site's own model on
    the pooled test set, averaged over sites (FCA's local-learning row; simulation only)."""

    encrypted_aggregation_refusal = "it aggregates nothing (every weight stays at its site): nothing to encrypt"

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        return personalization_figures(final, global_classifier=False, specialization=None,
                                       generalization=GENERALIZATION)
