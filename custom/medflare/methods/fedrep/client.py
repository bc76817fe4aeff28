"""FedRep site update: fit the personal head on the received body's features, then train the body."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from medflare.evaluation import SPECIALIZATION
from medflare.losses import balanced_softmax_loss
from medflare.methods.base import RoundContext
from medflare.methods.personalization import (
    PersonalizedTrainer,
    every_training_batch,
    fit_head,
    frozen_features,
    head_optimizer,
    own_model_generalization,
)

__all__ = ["FedRepTrainer"]


class FedRepTrainer(PersonalizedTrainer):
    """Each round: (1) the personal head trains ``head_epochs`` epochs with the received body frozen; (2) the body
    trains ``train.local_epochs`` epochs with the head frozen (the shared loop). Both use balanced softmax with the
    site's prior, as FCA's baselines do. The head is a private key (never sent or received, kept in the site's state);
    step (1) runs on cached features with a fresh optimizer each round, as the authors' code does."""

    def on_round_start(self, ctx: RoundContext) -> None:
        head = self.model.head
        head.requires_grad_(True)
        features, labels = frozen_features(self.model, every_training_batch(self), self.device)
        loss = fit_head(head, features, labels, self._loss, head_optimizer(self.model, head, self.train_cfg, ctx),
                        self.cfg.head_epochs, self.train_cfg.batch_size)
        self.record_locally(round=ctx.round, head_loss=loss)
        head.requires_grad_(False)  # the body phase below must not move the head

    def parameters_to_train(self) -> list[nn.Parameter]:
        """The body only (by name, so a restored optimizer matches whatever the head's grad flag is)."""
        return [p for name, p in self.model.named_parameters() if not name.startswith("head.")]

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        return self._loss(self.model(images)[labelled], labels[labelled])

    scores_pooled_test = True  # the generalization evaluation scores the site's own model on the pooled test set

    def extra_evaluations(self, split: str) -> dict[str, Any]:
        """The site's body and personal head as its last local training left them: specialization on its own
        split; generalization on the pooled test set (simulation), as FCA reports FedRep's."""
        return {SPECIALIZATION: self.evaluate(split), **own_model_generalization(self, split)}

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return balanced_softmax_loss(logits, labels, self.class_counts, eps=self.cfg.eps)
