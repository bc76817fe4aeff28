"""Symmetric cross-entropy: CE plus reverse CE, robust to noisy labels (RHFL / MDH-FL)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["symmetric_cross_entropy"]

# Clamping bounds of the reference: probabilities at 1e-7, the one-hot label at 1e-4 (log 1e-4 = -9.21).
_PROB_FLOOR = 1e-7
_LABEL_FLOOR = 1e-4


def symmetric_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, alpha: float = 0.1, beta: float = 1.0
) -> torch.Tensor:
    """``α · CE(z, y) + β · mean_i[−Σ_k clamp(p_k, 1e-7, 1) · log(clamp(onehot(y)_k, 1e-4, 1))]``.

    The reverse term equals ``−log(1e-4) · (1 − p_y) ≈ 9.21 · (1 − p_y)`` up to the clamping of p; RHFL/MDH-FL use
    α = 0.1, β = 1.

    References:
        Wang et al., Symmetric Cross Entropy for Robust Learning with Noisy Labels, ICCV 2019.
    """
    probs = F.softmax(logits, dim=1).clamp(min=_PROB_FLOOR, max=1.0)
    one_hot = F.one_hot(targets, logits.shape[1]).to(probs.dtype).clamp(min=_LABEL_FLOOR, max=1.0)
    reverse_ce = -(probs * torch.log(one_hot)).sum(dim=1).mean()
    return alpha * F.cross_entropy(logits, targets) + beta * reverse_ce
