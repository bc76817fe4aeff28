"""Binary cross-entropy losses of multi-label classification, with unknown entries (partial labels) left out."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["masked_bce", "weighted_bce"]


def masked_bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE over the known entries of multi-hot ``labels`` (1, 0; -1 = unknown, left out); 0 when none is known.

    The default supervised loss of a multi-label task: an entry a site did not annotate contributes nothing.

    Args:
        logits: ``[B, K]`` raw scores.
        labels: ``[B, K]`` integer entries in {1, 0, -1}.
    """
    known = labels >= 0
    return weighted_bce(logits, labels.clamp(min=0), known) * known.numel() / known.sum().clamp(min=1)


def weighted_bce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``mean over all B×K elements of weights · BCE(logits, targets)``; an element of weight 0 gets no gradient.

    This is the per-element weighting FedLSM's multi-label loss intends (spec §5(e)2): each entry is weighted
    before the mean, so a mask or a per-class weight acts on its own entries only.

    Args:
        logits: ``[B, K]`` raw scores.
        targets: ``[B, K]`` targets in [0, 1] (hard labels or mixed soft labels).
        weights: ``[B, K]`` non-negative element weights (bools act as a mask).
    """
    losses = F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="none")
    return (weights.to(logits.dtype) * losses).mean()
