"""scaffold's site update: the shared training loop with this method's local step."""

import torch

from medflare.methods.base import LocalTrainer


class ScaffoldTrainer(LocalTrainer):
    """Cross-entropy over the site's labelled images (BCE over known entries for multi-label tasks)."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.supervised_loss(self.model(images), labels)
