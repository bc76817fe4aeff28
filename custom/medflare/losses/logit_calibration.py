"""FedLC logit calibration: subtract a per-class margin that is larger for rarer local classes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.losses._counts import CountsLike, as_class_counts

__all__ = ["logit_calibrated_ce"]

# Fed-MAS/FedLC floor, so a class absent locally gets a finite (large) margin of tau * 100.
_COUNT_FLOOR = 1e-8


def logit_calibrated_ce(
    logits: torch.Tensor, targets: torch.Tensor, class_counts: CountsLike, tau: float = 0.5
) -> torch.Tensor:
    """``CE(z − τ · n^(−1/4), y)`` with the site's class counts n floored at 1e-8, mean over the batch.

    References:
        Zhang et al., Federated Learning with Label Distribution Skew via Logits Calibration, ICML 2022.
    """
    counts = as_class_counts(class_counts, logits.shape[1], device=logits.device).clamp(min=_COUNT_FLOOR)
    margins = (tau * counts.pow(-0.25)).to(logits.dtype)
    return F.cross_entropy(logits - margins, targets)
