"""Balanced softmax at the site: logits shifted by the log of the site's own class prior."""

import torch

from medflare.losses import balanced_softmax_loss
from medflare.methods.base import LocalTrainer


class BalancedSoftmaxTrainer(LocalTrainer):
    """CE(z + log π_site, y); evaluation uses the raw logits."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        logits = self.model(images)
        return balanced_softmax_loss(logits[labelled], labels[labelled], self.class_counts, eps=self.cfg.eps)
