"""Binary cross-entropy losses of multi-label classification, with unknown entries (partial labels) left out."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["masked_bce", "weighted_bce"]


def masked_bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE over the known entries of ``[B, K]`` multi-hot ``labels`` (1, 0; -1 = unknown, left out), 0 when
    none is known: the default multi-label loss, to which an entry a site did not annotate contributes nothing."""
    known = labels >= 0
    return weighted_bce(logits, labels.clamp(min=0), known) * known.numel() / known.sum().clamp(min=1)


def weighted_bce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``mean over all B×K elements of weights · BCE(logits, targets)``; an element of weight 0 gets no gradient.

    The per-element weighting FedLSM's multi-label loss intends (spec §5(e)2): targets in [0, 1] (hard or soft),
    each weight (bools: a mask) acting on its own entry before the mean.
    """
    losses = F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="none")
    return (weights.to(logits.dtype) * losses).mean()
