"""Fed-MAS site update: global divergence w before training, BSM + aux BSM + λ_f·L_f, ŵ during training, RF."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from medflare.losses import balanced_softmax_loss
from medflare.methods.base import LocalTrainer, RoundContext
from medflare.methods.fed_mas.prior import PriorFeatureCache, build_prior, check_finite_views
from medflare.methods.fed_mas.rescue import (
    ClassMeanAccumulator,
    distillation_distance,
    rescue_factor,
    stratified_subsample,
)

RF_KEY = "rf"


class FedMasTrainer(LocalTrainer):
    """The site side of Fed-MAS (and of its ``bsm-kd`` ablation, which sends no RF). The frozen prior lives here,
    not in the model, so it is never sent; w and ŵ (they reveal the label distribution) are only logged locally."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prior = build_prior(self.cfg.prior, self.cfg.prior_dim, self.cfg.prior_input_size, self.cfg.prior_model)
        self.prior.to(self.device)
        self.prior_cache: PriorFeatureCache | None = None
        if self.cfg.cache_prior_features:
            check_finite_views(self.train_dataset())
            self.prior_cache = PriorFeatureCache(self.run_prior)
        self.w_pass_seed = torch.initial_seed()  # the site's seed (job seed + site index): a fixed draw per round
        self.w_hat = ClassMeanAccumulator(int(self.data.num_classes))
        self.w = np.zeros(int(self.data.num_classes))

    @property
    def sends_rf(self) -> bool:
        return self.cfg.aggregation != "samples"

    def on_round_start(self, ctx: RoundContext) -> None:
        self.w_hat = ClassMeanAccumulator(int(self.data.num_classes))
        if self.sends_rf:
            self.w = self.global_divergence(bug_compat=self.cfg.repo_compat_teacher_bn and ctx.round == 0,
                                            round_index=ctx.round)

    @torch.no_grad()
    def global_divergence(self, bug_compat: bool = False, round_index: int = 0) -> np.ndarray:
        """w_k: mean distance of the received global model to the prior over class k's training images, in eval
        mode with training augmentation, shuffled, drop_last, as the authors do (spec §2(e)10). With
        ``w_pass_per_class`` = N, over a new stratified draw each round of at most N images per class."""
        accumulator = ClassMeanAccumulator(int(self.data.num_classes))
        self.model.eval()
        if bug_compat:
            self.prior.force_train_mode_for_repo_compat()
        loader, counts = self.w_pass_batches(round_index)
        for images, labels in loader:
            images, labels = images.to(self.device), labels.to(self.device)
            _, _, projected = self.model.forward_train(images)
            teacher = self.run_prior(images) if bug_compat else self.prior_features(images)  # never cache BN-drifted
            accumulator.add(labels, distillation_distance(projected, teacher))
        self.prior.restore_eval_mode()
        return accumulator.per_class(counts)

    def w_pass_batches(self, round_index: int) -> tuple[Any, np.ndarray]:
        """The w pass's batches and the per-class image counts its means divide by."""
        if self.cfg.w_pass_per_class <= 0:
            return self.train_loader(), np.asarray(self.data.class_counts)
        labels = np.asarray(self.train_dataset().labels)
        rows = stratified_subsample(labels, self.cfg.w_pass_per_class, (self.w_pass_seed, round_index))
        loader = DataLoader(Subset(self.train_dataset(), rows.tolist()), batch_size=self.train_cfg.batch_size)
        return loader, np.bincount(labels[rows], minlength=int(self.data.num_classes))

    def run_prior(self, images: torch.Tensor) -> torch.Tensor:
        """The prior's features, under autocast when ``prior_precision`` is reduced (bf16 on CPU, fp16 on CUDA)."""
        reduced = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        with torch.autocast(self.device.type, dtype=reduced, enabled=self.cfg.prior_precision == "reduced"):
            return self.prior(images).float()

    def prior_features(self, images: torch.Tensor) -> torch.Tensor:
        """The prior's features of a batch: from the cache when ``cache_prior_features`` is on."""
        return self.prior_cache(images) if self.prior_cache is not None else self.run_prior(images)

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, aux_logits, projected = self.model.forward_train(images)
        distance = distillation_distance(projected, self.prior_features(images))
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
        rf = rescue_factor(self.w, w_hat, invert=self.cfg.aggregation == "mas_inv", normalise=self.cfg.rf_normalise)
        self.record_locally(round=ctx.round, w=self.w.tolist(), w_hat=w_hat.tolist(), rf=rf)
        return {RF_KEY: rf}
