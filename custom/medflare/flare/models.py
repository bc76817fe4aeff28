"""The server's initial global model, built by the method's own builder (so every key exists server-side)."""

from __future__ import annotations

import torch
from torch import nn

from medflare.config import from_dict
from medflare.registry import get_method


def build_global_model(
    method: str,
    model: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    pretrained: str | None = None,
    method_args: dict | None = None,
    seed: int = 0,
) -> nn.Module:
    """Initial global network; FLARE's PTFileModelPersistor instantiates it from the job config.

    Seeded so that the same job starts from the same weights in the simulator, POC and production.
    """
    spec = get_method(method)
    method_cfg = from_dict(spec.config_cls, method_args or {}, f"method '{method}'")
    torch.manual_seed(seed)
    return spec.build_model(model, num_classes, in_channels, image_size, pretrained, method_cfg)
