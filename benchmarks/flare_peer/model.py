"""The model FLARE's own FedAvg recipe starts from: FLARE's persistor builds it from a class path and arguments."""

from __future__ import annotations

import torch

PREFIX = "net."  # the wrapped model's keys in the recipe's state dict


class PeerNet(torch.nn.Module):
    """medflare's model ``model`` built right after seeding torch with ``seed``: the initial model every side of the
    peer benchmark starts from (``fedavg_site.initial_state``), under the key prefix ``net.``."""

    def __init__(self, model: str, num_classes: int, in_channels: int, image_size: int, seed: int) -> None:
        super().__init__()
        from medflare.models import create_model

        torch.manual_seed(seed)
        self.net = create_model(model, num_classes, in_channels, image_size=image_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)
