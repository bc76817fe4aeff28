"""Focal loss: cross-entropy down-weighted on samples the model already classifies confidently."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["focal_loss"]


def focal_loss(
    logits: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0, class_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean_i[(1 − p_{y_i})^γ · w_{y_i} · CE_i]``, with p the unweighted softmax probability.

    γ = 0 gives plain cross-entropy. With class weights it is the plain mean of the weighted terms (not divided by
    the weights' sum as ``F.cross_entropy(weight=...)`` does), as in the FCA and LDAM-DRW reference code.

    References:
        Lin et al., Focal Loss for Dense Object Detection, ICCV 2017.
    """
    ce = F.cross_entropy(logits, targets, reduction="none")
    p_true = torch.exp(-ce)
    loss = (1.0 - p_true).pow(gamma) * ce
    if class_weights is not None:
        loss = loss * class_weights.to(device=loss.device, dtype=loss.dtype)[targets]
    return loss.mean()
