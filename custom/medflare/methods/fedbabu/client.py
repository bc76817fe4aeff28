"""FedBABU site update: the body learns under a frozen, shared random head; a fine-tuned head copy scores it."""

from __future__ import annotations

import copy
from typing import Any, Mapping

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
)

__all__ = ["FedBabuTrainer"]

_ROUND_KEYS = ("round", "total_rounds", "stage", "stage_round", "stage_rounds")  # a RoundContext as the state keeps it


class FedBabuTrainer(PersonalizedTrainer):
    """Balanced softmax through the frozen head (only the body trains and is averaged); the specialization evaluation
    fine-tunes a copy of the head on the site's training data for ``finetune_epochs`` and scores it. The head stays the
    server's random initialisation for the whole job (the model builder freezes it), so the global model is evaluated as
    the body with that head. The fine-tuned copy is never sent or kept: the final ``validate`` task is FedBABU's
    fine-tune-at-the-end, and every round's evaluation repeats it on the model of that moment (fitted once per model,
    used for val and test)."""

    _model_version = 0  # local rounds trained, so a fine-tuned head is reused only for the model it was fitted on
    _finetuned: tuple[int, nn.Module] | None = None
    # the round that last trained the body, kept across a restart: the fine-tune reads its lr (the loop's own round
    # context starts afresh in a restarted site, which fine-tuned at another lr than an uninterrupted one)
    _trained_in: RoundContext | None = None

    def on_round_start(self, ctx: RoundContext) -> None:
        self._model_version += 1
        self._trained_in = ctx

    def extra_state(self) -> dict[str, Any]:
        trained = self._trained_in
        where = {} if trained is None else {"trained_in": {key: getattr(trained, key) for key in _ROUND_KEYS}}
        return {**super().extra_state(), **where}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        super().load_extra_state(state)
        if "trained_in" in state:
            self._trained_in = RoundContext(**state["trained_in"])

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        return self._loss(self.model(images)[labelled], labels[labelled])

    def extra_evaluations(self, split: str) -> dict[str, Any]:
        """Specialization: the site's body with a head fine-tuned on its own training data."""
        return {SPECIALIZATION: self.evaluate_with_head(self._finetuned_head(), split)}

    def _finetuned_head(self) -> nn.Module:
        if self._finetuned is not None and self._finetuned[0] == self._model_version:
            return self._finetuned[1]
        head = copy.deepcopy(self.model.head).requires_grad_(True)
        features, labels = frozen_features(self.model, every_training_batch(self), self.device)
        optimizer = head_optimizer(self.model, head, self.train_cfg, self._trained_in or self._round_ctx)
        fit_head(head, features, labels, self._loss, optimizer, self.cfg.finetune_epochs, self.train_cfg.batch_size)
        self._finetuned = (self._model_version, head.eval())
        return head

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return balanced_softmax_loss(logits, labels, self.class_counts, eps=self.cfg.eps)
