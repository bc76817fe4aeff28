"""Moving parameters between torch modules and name -> numpy dictionaries."""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import torch
from torch import nn

from medflare.errors import PayloadError


def model_params(model: nn.Module, keep: Callable[[str], bool] = lambda key: True) -> dict[str, np.ndarray]:
    """The model's state dict as CPU numpy arrays, restricted to keys for which ``keep`` is true."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items() if keep(k)}


def load_params(model: nn.Module, params: Mapping[str, np.ndarray], keep: Callable[[str], bool]) -> list[str]:
    """Copy received arrays into the model for the keys ``keep`` accepts; other keys stay as they are.

    Returns:
        The keys loaded.

    Raises:
        PayloadError: on an unknown key or a shape mismatch (the server and site disagree on the model).
    """
    state = model.state_dict()
    loaded = []
    with torch.no_grad():
        for key, value in params.items():
            if not keep(key):
                continue
            if key not in state:
                raise PayloadError(f"received unknown parameter '{key}': the server model differs from the site's")
            target = state[key]
            tensor = torch.as_tensor(np.asarray(value))
            if tuple(tensor.shape) != tuple(target.shape):
                raise PayloadError(f"received '{key}' with shape {tuple(tensor.shape)}, model has {tuple(target.shape)}")
            target.copy_(tensor.to(dtype=target.dtype, device=target.device))
            loaded.append(key)
    return loaded
