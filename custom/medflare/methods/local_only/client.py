"""Local-only site update: the chosen loss on the site's own data; only meta and evaluation are sent."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.losses import balanced_softmax_loss, symmetric_cross_entropy
from medflare.methods.base import LocalTrainer

LOSSES = {"ce", "bsm", "sce"}


class LocalOnlyTrainer(LocalTrainer):
    """Trains the site's own model; the global evaluation task scores that same model (it receives nothing)."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        logits, targets = self.model(images)[labelled], labels[labelled]
        if self.cfg.loss == "bsm":
            return balanced_softmax_loss(logits, targets, self.class_counts, eps=self.cfg.eps)
        if self.cfg.loss == "sce":
            return symmetric_cross_entropy(logits, targets, self.cfg.sce_alpha, self.cfg.sce_beta)
        return F.cross_entropy(logits, targets)
