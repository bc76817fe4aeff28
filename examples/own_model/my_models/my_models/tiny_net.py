"""Your own ``nn.Module`` as a medflare model: ``TinyNet``, registered by this package's entry point ``tiny_net``.

medflare never imports this module by name: the package's ``pyproject.toml`` declares
``tiny_net = "my_models.tiny_net:tiny_net"`` in the ``medflare.models`` entry-point group, and medflare imports it
the first time a job names ``tiny_net``.
"""

from __future__ import annotations

import torch
from torch import nn

from medflare.models import Classifier


class TinyNet(nn.Module):
    """Two conv-BN-ReLU blocks and global average pooling: images ``[B, C, H, W]`` -> features ``[B, 2 * width]``.

    The network ends at its pooled features; medflare adds the linear head, so methods that keep, freeze or
    personalise the head (FedRep, FedBABU, FCA, ...) work on it unchanged.
    """

    def __init__(self, in_channels: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(1),
        )
        self.num_features = 2 * width

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.blocks(images)


def tiny_net(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """medflare's entry function: the task's sizes in, a :class:`Classifier` (backbone + linear head) out."""
    backbone = TinyNet(in_channels)
    return Classifier(backbone, nn.Linear(backbone.num_features, num_classes))
