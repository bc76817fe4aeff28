"""Per-class loss weights for long-tailed training: class-balanced (effective number) and its deferred schedule."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from medflare.errors import ConfigError
from medflare.losses._counts import CountsLike, as_class_counts

__all__ = ["class_balanced_weights", "drw_class_weights", "inverse_effective_number"]

Amounts = TypeVar("Amounts", np.ndarray, torch.Tensor)


def inverse_effective_number(amounts: Amounts, beta: float) -> Amounts:
    """Element-wise ``(1 − β) / (1 − β^n)``, one over Cui et al.'s effective number of n samples.

    1 everywhere for β = 0; about 1/n as β → 1. The positive amounts n (array or tensor, kept) need not be whole
    (Fed-MAS's ``mas_drw`` feeds normalised inverse rescue factors). ConfigError for β outside [0, 1).

    References:
        Cui et al., Class-Balanced Loss Based on Effective Number of Samples, CVPR 2019.
    """
    if not 0.0 <= beta < 1.0:
        raise ConfigError(f"effective-number beta must be in [0, 1), got {beta}")
    return (1.0 - beta) / (1.0 - beta**amounts)


def class_balanced_weights(class_counts: CountsLike, beta: float = 0.9999) -> torch.Tensor:
    """Weights ``(1 − β) / (1 − β^n_k)`` normalised to sum to K (float32, CPU).

    β = 0 gives uniform weights; β → 1 approaches inverse frequency. A class with no local sample counts as one (its
    weight never matters to the loss, but must stay finite for the normalisation).

    References:
        Cui et al., Class-Balanced Loss Based on Effective Number of Samples, CVPR 2019.
    """
    counts = as_class_counts(class_counts, device=torch.device("cpu")).clamp(min=1.0)
    weights = inverse_effective_number(counts, beta)
    return (weights * (len(counts) / weights.sum())).float()


def drw_class_weights(
    class_counts: CountsLike,
    current_round: int,
    total_rounds: int,
    beta: float = 0.9999,
    start_fraction: float = 0.8,
) -> torch.Tensor:
    """Deferred re-weighting: uniform weights before round ``start_fraction · total_rounds`` (zero-based; 0.8 in
    Fed-MAS / LDAM-DRW), class-balanced after.

    References:
        Cao et al., Learning Imbalanced Datasets with Label-Distribution-Aware Margin Loss, NeurIPS 2019.
    """
    # The slack keeps a product such as 0.55 · 100 = 55.00000000000001 from switching one round late (⌈f · R⌉ = 55).
    deferred = current_round < start_fraction * total_rounds - 1e-9
    return class_balanced_weights(class_counts, beta=0.0 if deferred else beta)
