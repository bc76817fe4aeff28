"""CIFAR-style ResNet-10 and ResNet-12 for small inputs: MDH-FL's two ResNets (spec §3(a)).

Built from torchvision's ResNet with BasicBlocks; the stem is a 3x3 stride-1 convolution without max-pooling
(so 28-px images keep a 28x28 map into the first stage), and the last stage is pooled to 4x4 as in the MDH-FL
and RHFL code, giving 512 x 16 = 8192 features for the head.
"""

from __future__ import annotations

from torch import nn

from medflare.models._registry import register_model
from medflare.models.classifier import Classifier

__all__ = ["cifar_resnet", "resnet10", "resnet12"]

_STEM_WIDTH = 64
_POOLED_SIDE = 4


def cifar_resnet(blocks: list[int], *, num_classes: int, in_channels: int) -> Classifier:
    """A BasicBlock ResNet with ``blocks`` blocks in its four stages (64 to 512 channels) and a CIFAR stem.

    Args:
        blocks: blocks per stage, e.g. ``[1, 1, 1, 1]`` for ResNet-10.
        num_classes: width of the head.
        in_channels: image channels.
    """
    import torchvision  # imported here: torchvision is slow to import, and listing models must stay fast

    network = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, blocks)
    network.conv1 = nn.Conv2d(in_channels, _STEM_WIDTH, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(network.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision's stem
    network.maxpool = nn.Identity()
    network.avgpool = nn.AdaptiveAvgPool2d(_POOLED_SIDE)
    network.fc = nn.Identity()
    features = network.layer4[-1].conv2.out_channels * _POOLED_SIDE**2
    return Classifier(network, nn.Linear(features, num_classes))


@register_model("resnet10")
def resnet10(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ResNet-10 (BasicBlock [1, 1, 1, 1]), CIFAR stem, 8192 features.

    References:
        Fang and Ye, Robust Federated Learning With Noisy and Heterogeneous Clients, CVPR 2022 (RHFL's models);
        He et al., Deep Residual Learning for Image Recognition, CVPR 2016.
    """
    return cifar_resnet([1, 1, 1, 1], num_classes=num_classes, in_channels=in_channels)


@register_model("resnet12")
def resnet12(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ResNet-12 (BasicBlock [2, 1, 1, 1]), CIFAR stem, 8192 features.

    References:
        Fang and Ye, Robust Federated Learning With Noisy and Heterogeneous Clients, CVPR 2022 (RHFL's models);
        He et al., Deep Residual Learning for Image Recognition, CVPR 2016.
    """
    return cifar_resnet([2, 1, 1, 1], num_classes=num_classes, in_channels=in_channels)
