"""Where tensors should live: the code is device-agnostic and asks here once."""

from __future__ import annotations

import torch

__all__ = ["get_device", "place_model"]


def get_device() -> torch.device:
    """The first CUDA device if one is available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def place_model(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``model`` on ``device`` as a site trains it: on CUDA in channels_last, which its convolutions under autocast
    run fastest in; elsewhere unchanged. One place, so a site and a benchmark's timing probe agree."""
    device = torch.device(device)
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model
