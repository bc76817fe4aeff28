"""LDAM-DRW site update: margin loss on cosine logits, class-balanced weights in the last rounds."""

from __future__ import annotations

from functools import cached_property

import torch

from medflare.losses import LDAMLoss, drw_class_weights
from medflare.methods.base import LocalTrainer, RoundContext

__all__ = ["LdamDrwTrainer"]


class LdamDrwTrainer(LocalTrainer):
    """LDAM on the site's labelled samples, re-weighted per class once DRW switches on. Loss = Σ_i w_{y_i} · CE(s ·
    (cos_i − m_{y_i} · onehot(y_i)), y_i) / Σ_i w_{y_i}, with margins m_k ∝ n_k^(−1/4) (rescaled so the rarest local
    class gets ``max_margin``; 0 for a class the site lacks) and w uniform before round ⌈f · R⌉, class-balanced
    (effective number, β; Cui et al., CVPR 2019) from then on. Margins and weights use this site's own training counts,
    which never leave it. Evaluation scores s · cos, the scale the loss trains (the argmax is the raw cosines')."""

    class_weights: torch.Tensor | None = None  # this round's DRW weights; None (uniform) before the first round

    @cached_property
    def ldam_loss(self) -> LDAMLoss:
        """The margin loss, built once from this site's training counts (they do not change across rounds)."""
        return LDAMLoss(self.class_counts, max_margin=self.cfg.max_margin, scale=self.cfg.scale).to(self.device)

    def on_round_start(self, ctx: RoundContext) -> None:
        self.class_weights = drw_class_weights(self.class_counts, current_round=ctx.round,
                                               total_rounds=ctx.total_rounds, beta=self.cfg.drw_beta,
                                               start_fraction=self.cfg.drw_start_fraction)

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        cosines = self.model(images)[labelled]
        return self.ldam_loss(cosines, labels[labelled], class_weights=self.class_weights)

    def predict_logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.cfg.scale * self.model(images)
