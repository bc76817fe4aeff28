"""Local-only server rule: nothing to aggregate; FCA's named final figures (specialization only)."""

from __future__ import annotations

from typing import Any, Mapping

from medflare.evaluation import personalization_figures
from medflare.methods.base import ServerRule

__all__ = ["LocalOnlyRule"]


class LocalOnlyRule(ServerRule):
    """No weights arrive. Each site's evaluation scores its own model on its own test split, so that is the
    specialization (``final.site_mean``); there is no global classifier, hence no generalization figure."""

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        return personalization_figures(final, global_classifier=False, specialization=None)
