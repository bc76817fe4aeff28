"""Fed-MAS site update: global divergence w before training, BSM + aux BSM + λ_f·L_f, ŵ during training, RF."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from medflare.losses import balanced_softmax_loss
from medflare.methods.base import LocalTrainer, RoundContext
from medflare.methods.fed_mas.prior import build_prior
from medflare.methods.fed_mas.rescue import ClassMeanAccumulator, distillation_distance, rescue_factor

RF_KEY = "rf"


class FedMasTrainer(LocalTrainer):
    """The site side of Fed-MAS (and of its ``bsm-kd`` ablation, which sends no RF).

    The frozen prior lives here, not in the model, so it is never part of what the site sends.
    w and ŵ stay at the site (they reveal the label distribution); they are logged locally only.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prior = build_prior(self.cfg.prior, self.cfg.prior_dim, self.cfg.prior_input_size, self.cfg.prior_model)
        self.prior.to(self.device)
        self.w_hat = ClassMeanAccumulator(int(self.data.num_classes))
        self.w = np.zeros(int(self.data.num_classes))

    @property
    def sends_rf(self) -> bool:
        return self.cfg.aggregation != "samples"

    def on_round_start(self, ctx: RoundContext) -> None:
        self.w_hat = ClassMeanAccumulator(int(self.data.num_classes))
        if self.sends_rf:
            self.w = self.global_divergence(bug_compat=self.cfg.repo_compat_teacher_bn and ctx.round == 0)

    @torch.no_grad()
    def global_divergence(self, bug_compat: bool = False) -> np.ndarray:
        """w_k: mean distance of the received global model to the prior over class k's training images.

        Eval mode, training augmentation, shuffled, drop_last, as the authors do (spec §2(e)10).
        """
        accumulator = ClassMeanAccumulator(int(self.data.num_classes))
        self.model.eval()
        if bug_compat:
            self.prior.force_train_mode_for_repo_compat()
        for images, labels in self.train_loader():
            images, labels = images.to(self.device), labels.to(self.device)
            _, _, projected = self.model.forward_train(images)
            accumulator.add(labels, distillation_distance(projected, self.prior(images)))
        self.prior.restore_eval_mode()
        return accumulator.per_class(self.data.class_counts)

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, aux_logits, projected = self.model.forward_train(images)
        distance = distillation_distance(projected, self.prior(images))
        self.w_hat.add(labels, distance)
        labelled = labels >= 0
        counts = self.class_counts
        loss = balanced_softmax_loss(logits[labelled], labels[labelled], counts, eps=self.cfg.eps)
        loss = loss + self.cfg.aux_head_weight * balanced_softmax_loss(
            aux_logits[labelled], labels[labelled], counts, eps=self.cfg.eps
        )
        return loss + self.cfg.lambda_f * distance.mean()

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        if not self.sends_rf:
            return {}
        w_hat = self.w_hat.per_class(self.data.class_counts)
        rf = rescue_factor(self.w, w_hat, invert=self.cfg.aggregation == "mas_inv")
        self.record_locally(round=ctx.round, w=self.w.tolist(), w_hat=w_hat.tolist(), rf=rf)
        return {RF_KEY: rf}
