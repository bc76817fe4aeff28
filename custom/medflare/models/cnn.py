"""A small convolutional network for tests and CPU demos: trains in seconds on 28x28 images."""

from __future__ import annotations

from torch import nn

from medflare.models._registry import register_model
from medflare.models.classifier import Classifier

__all__ = ["cnn"]

_CNN_WIDTHS = (32, 64, 128)


def _conv_bn_relu(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


@register_model("cnn")
def cnn(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """Three conv-BN-ReLU blocks (32, 64, 128 channels), 2x max-pooling after the first two, global average pool.

    About 93k parameters; any input of at least 4x4 pixels works.
    """
    layers: list[nn.Module] = []
    channels = in_channels
    for index, width in enumerate(_CNN_WIDTHS):
        layers.append(_conv_bn_relu(channels, width))
        if index < len(_CNN_WIDTHS) - 1:
            layers.append(nn.MaxPool2d(2))
        channels = width
    backbone = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
    return Classifier(backbone, nn.Linear(channels, num_classes))
