"""LDAM: cross-entropy with a class-dependent margin that is larger for rarer classes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medflare.losses._counts import CountsLike, as_class_counts

__all__ = ["LDAMLoss"]


class LDAMLoss(nn.Module):
    """Label-distribution-aware margin loss ``CE(s · (z − m_y · onehot(y)), y)``.

    The margins are ``m_k ∝ n_k^(−1/4)``, rescaled so the largest (rarest class) is ``max_margin``.

    LDAM expects cosine logits in [−1, 1] (L2-normalised features and classifier rows, e.g.
    :class:`medflare.models.CosineLinear` as the head); the scale s then sets the softmax temperature. Combine
    with :func:`drw_class_weights` for LDAM-DRW. A class with zero local samples is treated as having one, so
    its margin stays finite (the reference divides by zero).

    Attributes:
        margins: per-class margins ``[K]`` (a buffer, so it follows the module's device).
        max_margin: margin of the rarest class.
        scale: logit scale s.

    References:
        Cao et al., Learning Imbalanced Datasets with Label-Distribution-Aware Margin Loss, NeurIPS 2019.
    """

    margins: torch.Tensor

    def __init__(self, class_counts: CountsLike, max_margin: float = 0.5, scale: float = 30.0) -> None:
        """Compute the margins from the training counts.

        Args:
            class_counts: training count per class ``[K]``.
            max_margin: margin of the rarest class.
            scale: logit scale s.
        """
        super().__init__()
        counts = as_class_counts(class_counts, device=torch.device("cpu")).clamp(min=1.0)
        margins = counts.pow(-0.25)
        self.register_buffer("margins", (margins * (max_margin / margins.max())).float())
        self.max_margin = max_margin
        self.scale = scale

    def forward(
        self, logits: torch.Tensor, targets: torch.Tensor, class_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean LDAM loss over the batch, optionally with per-class weights (as ``F.cross_entropy(weight=...)``)."""
        margins = self.margins.to(logits.dtype)
        target_margin = F.one_hot(targets, logits.shape[1]).to(logits.dtype) * margins[targets, None]
        weight = class_weights.to(device=logits.device, dtype=logits.dtype) if class_weights is not None else None
        return F.cross_entropy(self.scale * (logits - target_margin), targets, weight=weight)
