"""MOON site update: cross-entropy plus a contrastive term over three models' pooled features. The two reference models
are frozen copies held by the trainer (not submodules of the site's model), so they never enter the state dict, the
optimizer or the payload."""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from medflare.methods.base import LocalTrainer, RoundContext

__all__ = ["MoonTrainer", "frozen_copy", "model_contrastive_loss"]


def model_contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor,
                           temperature: float) -> torch.Tensor:
    """MOON's ℓ_con (Eq. 3), mean over the batch, of the trained model's ``[B, D]`` representations z, the global
    model's (the positive) and the site's previous model's (the negative): ℓ_con = −log(exp(sim(z, z_glob)/τ) /
    (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ))) with cosine similarity, computed as a 2-way cross-entropy whose
    target is the global model (numerically stable)."""
    similarities = torch.stack((F.cosine_similarity(z, z_global, dim=1), F.cosine_similarity(z, z_previous, dim=1)),
                               dim=1)
    positive_is_global = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    return F.cross_entropy(similarities / temperature, positive_is_global)


def frozen_copy(model: nn.Module, into: nn.Module | None = None) -> nn.Module:
    """A gradient-free, eval-mode copy of ``model``'s current state (parameters and buffers), written ``into`` an
    earlier copy of the same architecture when given (saves re-allocating every round)."""
    if into is None:
        into = copy.deepcopy(model)
        for param in into.parameters():
            param.requires_grad_(False)
            param.grad = None  # deepcopy also copies the source's last gradients
    else:
        into.load_state_dict(model.state_dict())
    return into.eval()


class MoonTrainer(LocalTrainer):
    """CE over labelled samples (BCE over known entries for multi-label tasks) + μ · ℓ_con over every sample, on the
    model's pooled features. z is ``forward_features`` of the model being trained (no projection head: the network, and
    so the payload, stay FedAvg's); z_glob comes from a frozen copy of the model received this round, z_prev from a
    frozen copy of this site's model at the end of its previous round, which stays at the site (in its saved state) and
    is never sent. Before a site has trained once there is no previous model and the term is skipped: MOON's code uses
    the global model as z_prev then, making ℓ_con the constant log 2 with zero gradient. ℓ_con needs no labels, so
    unlabelled samples (label −1) still contribute to it."""

    uses_unlabelled_samples = True  # the contrastive term needs no labels

    global_model: nn.Module | None = None  # frozen copy of this round's received model
    previous_model: nn.Module | None = None  # frozen copy of this site's model after its last round; never sent

    def on_round_start(self, ctx: RoundContext) -> None:
        self.global_model = frozen_copy(self.model, into=self.global_model)

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = self.model.forward_features(images)
        logits = self.model.forward_head(features)
        ce = self.supervised_loss(logits, labels)  # 0 (not NaN) for a batch with no label; BCE if multi-label
        if self.previous_model is None or self.cfg.mu == 0:
            return ce
        with torch.no_grad():
            z_global = self.global_model.forward_features(images)
            z_previous = self.previous_model.forward_features(images)
        return ce + self.cfg.mu * model_contrastive_loss(features, z_global, z_previous, self.cfg.temperature)

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        # The loop's end-of-round hook: it runs once, after the last step, on exactly the weights about to be sent.
        self.previous_model = frozen_copy(self.model, into=self.previous_model)
        return {}

    def extra_state(self) -> dict[str, Any]:
        previous = self.previous_model
        return {} if previous is None else {"previous_model": {k: v.cpu() for k, v in previous.state_dict().items()}}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if "previous_model" in state:
            self.previous_model = frozen_copy(self.model, into=self.previous_model)
            self.previous_model.load_state_dict(state["previous_model"])
