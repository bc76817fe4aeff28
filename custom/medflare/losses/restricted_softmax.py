"""FedRS restricted softmax: scale down the logits of classes a site does not have before the softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.errors import ConfigError, DataError
from medflare.losses._counts import CountsLike, as_class_counts

__all__ = ["RESTRICTION_MODES", "restricted_logits", "restricted_softmax_loss", "restriction_scales"]

#: hard: the paper's α for every class the site lacks, 1 otherwise; soft: the authors' code, α + (1 − α)·n_c/max n.
RESTRICTION_MODES = ("hard", "soft")


def restriction_scales(
    class_counts: CountsLike, alpha: float, mode: str = "hard", device: torch.device | None = None
) -> torch.Tensor:
    """Per-class factors ``[K]`` (float64) that multiply a site's logits in its local loss.

    ``hard`` (FedRS paper, Eq. 4): 1 for a class the site has (count > 0), ``alpha`` for a class it lacks, so the
    site's softmax stops pulling the missing classes' weight vectors towards its own features. ``soft`` (the
    authors' released code): ``alpha + (1 − alpha) · n_c / max_j n_j``, which also restricts rare classes.
    A label-set mask (1 = annotated) works as ``class_counts`` in hard mode; ``alpha`` = 1 is plain softmax.
    ConfigError for alpha outside [0, 1] or an unknown mode, DataError for invalid or all-zero counts.

    References:
        Li and Zhan, FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data, KDD 2021.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"restricted softmax alpha must be in [0, 1], got {alpha}")
    if mode not in RESTRICTION_MODES:
        raise ConfigError(f"restricted softmax mode must be one of {RESTRICTION_MODES}, got '{mode}'")
    counts = as_class_counts(class_counts, device=device)
    if counts.max() <= 0:
        raise DataError("class_counts are all zero: the site has no class to keep unrestricted")
    if mode == "hard":
        return torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, alpha))
    return alpha + (1.0 - alpha) * counts / counts.max()


def restricted_logits(logits: torch.Tensor, class_counts: CountsLike, alpha: float, mode: str = "hard") -> torch.Tensor:
    """``logits · scales`` (column-wise) with :func:`restriction_scales`; for the local loss only, never to predict.

    The whole logit is scaled (a head's bias too): the paper's heads have no bias, medflare's linear heads do.
    """
    scales = restriction_scales(class_counts, alpha, mode, device=logits.device)
    if scales.shape[0] != logits.shape[1]:
        raise DataError(f"class_counts have {scales.shape[0]} classes but the logits {logits.shape[1]}")
    return logits * scales.to(logits.dtype)


def restricted_softmax_loss(
    logits: torch.Tensor, targets: torch.Tensor, class_counts: CountsLike, alpha: float, mode: str = "hard"
) -> torch.Tensor:
    """``CE(restricted_logits(z), y)``, mean over the batch (FedRS's local loss with cross-entropy)."""
    return F.cross_entropy(restricted_logits(logits, class_counts, alpha, mode), targets)
