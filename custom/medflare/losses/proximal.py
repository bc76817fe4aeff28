"""FedProx's proximal penalty that keeps local weights near the round's global weights."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from medflare.errors import ConfigError, PayloadError

__all__ = ["proximal_term"]


def proximal_term(
    model: nn.Module, global_params: Mapping[str, torch.Tensor | np.ndarray], mu: float
) -> torch.Tensor:
    """``(μ/2) · Σ ||w − w_g||²`` over the model's trainable parameters, matched by name.

    Buffers and frozen parameters are not penalised; the global values are constants. ConfigError for μ < 0,
    PayloadError when a trainable parameter is missing from ``global_params`` or has another shape.

    References:
        Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020.
    """
    if mu < 0:
        raise ConfigError(f"FedProx mu must be >= 0, got {mu}")
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, _ in trainable if name not in global_params]
    if missing:
        raise PayloadError(f"global parameters lack {len(missing)} trainable parameters of the model: {missing[:8]}")
    squared_distance = torch.zeros((), device=trainable[0][1].device if trainable else None)
    for name, param in trainable:
        reference = torch.as_tensor(global_params[name], device=param.device, dtype=param.dtype).detach()
        if reference.shape != param.shape:
            raise PayloadError(
                f"global parameter '{name}' has shape {list(reference.shape)}, the model's {list(param.shape)}"
            )
        squared_distance = squared_distance + (param - reference).pow(2).sum()
    return 0.5 * mu * squared_distance
