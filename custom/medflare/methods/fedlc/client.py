"""FedLC site update: cross-entropy on logits calibrated by the site's own class counts."""

from __future__ import annotations

import torch

from medflare.losses import logit_calibrated_ce
from medflare.methods.base import LocalTrainer

__all__ = ["FedLcTrainer"]


class FedLcTrainer(LocalTrainer):
    """CE(z − τ · n^(−1/4), y) over the site's labelled samples; evaluation uses the raw logits. Subtracting the larger
    offset from a rarer class's logit makes the loss demand a larger raw margin for it, so the site stops pushing rare
    (or absent: count floored at 1e-8, offset 100·τ) classes down. The counts are this site's training counts and never
    leave the site."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        logits = self.model(images)[labelled]
        return logit_calibrated_ce(logits, labels[labelled], self.class_counts, tau=self.cfg.tau)
