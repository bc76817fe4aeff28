"""FedProx site update: the shared loop with a proximal penalty to the round's global weights."""

import torch

from medflare.losses import proximal_term
from medflare.methods.base import LocalTrainer, RoundContext


class FedProxTrainer(LocalTrainer):
    """CE (BCE for multi-label tasks) + (μ/2)·||w − w_global||², w_global being the model received this round."""

    def on_round_start(self, ctx: RoundContext) -> None:
        self.global_params = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        supervised = self.supervised_loss(self.model(images), labels)  # CE, or BCE for multi-label tasks
        return supervised + proximal_term(self.model, self.global_params, self.cfg.mu)
