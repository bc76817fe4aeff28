"""Where tensors should live: the code is device-agnostic and asks here once."""

from __future__ import annotations

import torch

__all__ = ["get_device"]


def get_device() -> torch.device:
    """The first CUDA device if one is available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
