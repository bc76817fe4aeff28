"""Balanced softmax: cross-entropy on logits shifted by the log of the local class prior."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.errors import DataError
from medflare.losses._counts import CountsLike, as_class_counts

__all__ = ["balanced_softmax_loss"]


def balanced_softmax_loss(
    logits: torch.Tensor, targets: torch.Tensor, class_counts: CountsLike, eps: float = 1e-12
) -> torch.Tensor:
    """``CE(z + log(π + eps), y)`` with π = class_counts / sum(class_counts), mean over the batch.

    The shift is used only inside the loss: predict and evaluate with the raw logits. A class absent from the
    counts gets the offset log(eps) (about -27.6 for 1e-12, -20.7 for 1e-9), so the site does not push down
    the logits of classes it never sees.

    Args:
        logits: raw logits ``[B, K]``.
        targets: class indices ``[B]``.
        class_counts: the site's training-set count per class ``[K]`` (tensor, array or sequence).
        eps: added to π before the log; Fed-MAS uses 1e-12, FCA 1e-9.

    Raises:
        DataError: if the counts have the wrong shape, are negative, or are all zero.

    References:
        Ren et al., Balanced Meta-Softmax for Long-Tailed Visual Recognition, NeurIPS 2020.
    """
    counts = as_class_counts(class_counts, logits.shape[1], device=logits.device)
    total = counts.sum()
    if total <= 0:
        raise DataError("class_counts are all zero: the class prior is undefined")
    log_prior = torch.log(counts / total + eps).to(logits.dtype)
    return F.cross_entropy(logits + log_prior, targets)
