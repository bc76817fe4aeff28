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

    The shift is used only inside the loss (predict with the raw logits). A class absent from the counts gets
    log(eps) (Fed-MAS's 1e-12: -27.6; FCA's 1e-9: -20.7), so the site does not push down classes it never sees.
    DataError for counts of the wrong shape, negative or all zero.

    References:
        Ren et al., Balanced Meta-Softmax for Long-Tailed Visual Recognition, NeurIPS 2020.
    """
    counts = as_class_counts(class_counts, logits.shape[1], device=logits.device)
    total = counts.sum()
    if total <= 0:
        raise DataError("class_counts are all zero: the class prior is undefined")
    log_prior = torch.log(counts / total + eps).to(logits.dtype)
    return F.cross_entropy(logits + log_prior, targets)
