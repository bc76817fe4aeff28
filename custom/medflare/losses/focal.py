"""Focal loss: cross-entropy down-weighted on samples the model already classifies confidently."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["focal_loss"]


def focal_loss(
    logits: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0, class_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean_i[(1 − p_{y_i})^γ · w_{y_i} · CE_i]``, with p the unweighted softmax probability.

    With class weights this is the plain mean of the weighted per-sample terms (not divided by the sum of the
    weights as ``F.cross_entropy(weight=...)`` does), as in the FCA and LDAM-DRW reference code.

    Args:
        logits: raw logits ``[B, K]``.
        targets: class indices ``[B]``.
        gamma: focusing parameter; 0 gives plain cross-entropy.
        class_weights: optional per-class weights ``[K]`` (e.g. :func:`class_balanced_weights`).

    References:
        Lin et al., Focal Loss for Dense Object Detection, ICCV 2017.
    """
    ce = F.cross_entropy(logits, targets, reduction="none")
    p_true = torch.exp(-ce)
    loss = (1.0 - p_true).pow(gamma) * ce
    if class_weights is not None:
        loss = loss * class_weights.to(device=loss.device, dtype=loss.dtype)[targets]
    return loss.mean()
