"""LDAM: cross-entropy with a class-dependent margin that is larger for rarer classes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medflare.losses._counts import CountsLike, as_class_counts

__all__ = ["LDAMLoss", "ldam_margins"]


def ldam_margins(class_counts: CountsLike, max_margin: float) -> torch.Tensor:
    """float32 ``[K]`` per-class margins ``m_k ∝ n_k^(−1/4)`` over present classes, largest = ``max_margin``; 0
    where n_k = 0 (all zero when the site has no labelled sample)."""
    counts = as_class_counts(class_counts, device=torch.device("cpu"))
    present = counts > 0
    margins = torch.zeros_like(counts)
    margins[present] = counts[present].pow(-0.25)
    if bool(present.any()):
        margins = margins * (max_margin / margins.max())
    return margins.float()


class LDAMLoss(nn.Module):
    """Label-distribution-aware margin loss ``CE(s · (z − m_y · onehot(y)), y)``.

    Margins are :func:`ldam_margins` (a buffer). A class the site lacks gets margin 0 and takes no part in the
    rescaling, as in Fed-MAS's LDAM baseline: treating it as the rarest would shrink every present class's margin
    (counts [500, 100, 0] give [0.334, 0.5, 0], not [0.106, 0.158, 0.5]). LDAM expects cosine logits in [−1, 1]
    (e.g. a :class:`medflare.models.CosineLinear` head), the scale s setting the softmax temperature; with
    :func:`drw_class_weights` it is LDAM-DRW.

    References:
        Cao et al., Learning Imbalanced Datasets with Label-Distribution-Aware Margin Loss, NeurIPS 2019.
    """

    margins: torch.Tensor

    def __init__(self, class_counts: CountsLike, max_margin: float = 0.5, scale: float = 30.0) -> None:
        super().__init__()
        self.register_buffer("margins", ldam_margins(class_counts, max_margin))
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
