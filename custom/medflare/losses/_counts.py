"""Validation of per-class count vectors shared by the prior-aware losses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from medflare.errors import DataError

__all__ = ["CountsLike", "as_class_counts"]

#: A length-K vector of per-class sample counts (float counts, e.g. expected counts, are allowed).
CountsLike = torch.Tensor | np.ndarray | Sequence[float]


def as_class_counts(
    class_counts: CountsLike, num_classes: int | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The counts as a float64 ``[K]`` tensor (on ``device``, default the input's or the CPU); DataError unless it
    has ``num_classes`` entries (None: any), all finite and non-negative."""
    counts = torch.as_tensor(
        np.asarray(class_counts) if not isinstance(class_counts, torch.Tensor) else class_counts.detach(),
        dtype=torch.float64,
        device=device,
    )
    if counts.ndim != 1 or (num_classes is not None and counts.shape[0] != num_classes):
        expected = f"[{num_classes}]" if num_classes is not None else "[K]"
        raise DataError(f"class_counts must have shape {expected}, got {list(counts.shape)}")
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise DataError(f"class_counts must be finite and >= 0, got {counts.tolist()}")
    return counts
