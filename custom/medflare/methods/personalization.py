"""What the personalized methods (FCA, FedRep, FedBABU) share: a trainer that keeps its whole local model in the site
state and can score it with another head, and training a linear head on a frozen extractor's features. Head training
(FedRep's head phase, FedBABU's final fine-tune): the extractor is frozen while the head trains, so its features are
computed once (one pass over the site's training batches, eval mode, no gradient) and the head then runs its epochs over
the cached features. That keeps a 10-epoch head phase at the cost of one forward pass."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader

from medflare.evaluation import GENERALIZATION, SPECIALIZATION, personalization_figures
from medflare.methods.base import LocalTrainer, RoundContext, ServerRule, TrainConfig
from medflare.models import Classifier
from medflare.optim import build_optimizer, set_step_lr

__all__ = ["FiguresRule", "HeadLoss", "PersonalizedTrainer", "every_training_batch", "fit_head", "frozen_features",
           "head_optimizer", "own_model_generalization"]

HeadLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> scalar loss


def frozen_features(model: Classifier, loader: DataLoader, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as the head sees them (after the classifier dropout, here off) and labels of the labelled samples,
    from one pass in eval mode (BatchNorm uses its running statistics; the mode is restored afterwards)."""
    was_training = model.training
    model.eval()
    features, labels = [], []
    with torch.no_grad():
        for images, batch_labels in loader:
            keep = batch_labels >= 0
            if not bool(keep.any()):
                continue
            pooled = model.forward_head(model.forward_features(images.to(device)), pre_logits=True)
            features.append(pooled[keep.to(device)])
            labels.append(batch_labels[keep].to(device))
    model.train(was_training)
    if not features:
        return torch.zeros(0, model.num_features, device=device), torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(features), torch.cat(labels)


def every_training_batch(trainer: LocalTrainer) -> DataLoader:
    """Every training sample once, in order: the head trains on all of the site's labelled images (the shuffled
    training loader drops its last partial batch, which left a random remainder of up to a batch out)."""
    return DataLoader(trainer.train_dataset(), batch_size=trainer.train_cfg.eval_batch_size, shuffle=False)


def head_optimizer(model: nn.Module, head: nn.Module, cfg: TrainConfig, ctx: RoundContext) -> torch.optim.Optimizer:
    """A fresh optimizer of the job's kind for ``head`` alone, at the lr the schedule gives round ``ctx``."""
    optimizer = build_optimizer(model, cfg, trainable=list(head.parameters()))
    set_step_lr(optimizer, cfg, ctx.stage_round, ctx.stage_rounds, 0, 1)
    return optimizer


def fit_head(head: nn.Module, features: torch.Tensor, labels: torch.Tensor, loss_fn: HeadLoss,
             optimizer: torch.optim.Optimizer, epochs: int, batch_size: int) -> float:
    """``epochs`` passes of shuffled mini-batches over cached ``[N, F]`` features and ``[N]`` labels, updating only
    ``head`` (the optimizer's parameters) with the method's ``loss_fn``; the mean loss over the steps (0.0 if none)."""
    head.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(labels)).to(labels.device)
        for start in range(0, len(labels), batch_size):
            rows = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(head(features[rows]), labels[rows])
            loss.backward()
            optimizer.step()
            total, steps = total + float(loss.detach()), steps + 1
    return total / max(steps, 1)


def own_model_generalization(trainer: LocalTrainer, split: str) -> dict[str, Any]:
    """FCA's generalization of a method without a global classifier (FedRep, local-only): the site's own model on the
    pooled test set, ``{GENERALIZATION: EvalStats}`` for the test split (the server averages it over sites). Only a
    simulated site holds ``data.pooled_test`` (built when the trainer class sets ``scores_pooled_test``)."""
    if split != "test" or getattr(trainer.data, "pooled_test", None) is None:
        return {}
    return {GENERALIZATION: trainer.evaluate("pooled_test")}


class PersonalizedTrainer(LocalTrainer):
    """A trainer whose site keeps a model of its own next to the global one. Its whole local model is part of the site
    state, so after a restart the specialization evaluation (before the received model is loaded) scores the model the
    site last trained; :meth:`evaluate_with_head` scores the extractor with another head (FCA's personal head, FedBABU's
    fine-tuned copy) through the shared evaluation code."""

    _scoring_head: nn.Module | None = None  # set only while :meth:`evaluate_with_head` runs

    def extra_state(self) -> dict[str, Any]:
        return {"local_model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if "local_model" in state:
            self.model.load_state_dict(state["local_model"])

    def predict_logits(self, images: torch.Tensor) -> torch.Tensor:
        if self._scoring_head is None:
            return super().predict_logits(images)
        return self._scoring_head(self.model.forward_head(self.model.forward_features(images), pre_logits=True))

    def evaluate_with_head(self, head: nn.Module, split: str) -> Any:
        """Summable evaluation statistics on ``split`` of the model's extractor followed by ``head``."""
        self._scoring_head = head
        try:
            return self.evaluate(split)
        finally:
            self._scoring_head = None


class FiguresRule(ServerRule):
    """FedAvg with FCA's named final figures (:func:`~medflare.evaluation.personalization_figures`): a subclass says
    whether the global model has a classifier and which site evaluations score each site's own model."""

    global_classifier = True
    specialization: str | None = SPECIALIZATION  # None: the main evaluation (single-model methods)
    generalization: str | None = None

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        return personalization_figures(final, global_classifier=self.global_classifier,
                                       specialization=self.specialization, generalization=self.generalization)
