"""Local-only site update: the chosen loss on the site's own data; only meta and evaluation are sent."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from medflare.losses import balanced_softmax_loss, symmetric_cross_entropy
from medflare.methods.base import LocalTrainer
from medflare.methods.personalization import own_model_generalization

LOSSES = {"ce", "bsm", "sce"}


class LocalOnlyTrainer(LocalTrainer):
    """Trains the site's own model with the chosen loss (MDH-FL's local epochs reuse it)."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        logits, targets = self.model(images)[labelled], labels[labelled]
        if self.cfg.loss == "bsm":
            return balanced_softmax_loss(logits, targets, self.class_counts, eps=self.cfg.eps)
        if self.cfg.loss == "sce":
            return symmetric_cross_entropy(logits, targets, self.cfg.sce_alpha, self.cfg.sce_beta)
        return F.cross_entropy(logits, targets)


class LocalOnlyReferenceTrainer(LocalOnlyTrainer):
    """The local-only method's trainer: the global evaluation task scores the site's own model (it receives
    nothing), and the generalization evaluation scores it on the pooled test set (simulation), as FCA reports
    local learning's generalization."""

    scores_pooled_test = True

    def extra_evaluations(self, split: str) -> dict[str, Any]:
        return own_model_generalization(self, split)
