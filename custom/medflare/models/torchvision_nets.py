"""torchvision classification networks behind the Classifier interface.

Each network is built by torchvision with ``weights=None`` (nothing is downloaded) and with the requested number
of classes, so the library's own head initialisation is kept; that linear layer becomes ``Classifier.head`` and
the library's classifier slot becomes an identity, so the backbone returns pooled features. The dropout of the
library's classifier (0.2 for MobileNetV2 and EfficientNet-B0) becomes ``Classifier.head_dropout``.

For ``in_channels != 3`` the stem convolution is replaced by a freshly initialised one with the same geometry.
All networks accept 28x28 inputs; DenseNet-121 needs one change for that, see :func:`densenet121`.
"""

from __future__ import annotations

from torch import nn

from medflare.models._registry import register_model
from medflare.models.classifier import Classifier

__all__ = ["densenet121", "efficientnet_b0", "mobilenet_v2", "resnet18", "resnet50", "shufflenet"]


def _to_classifier(network: nn.Module, classifier_slot: str, in_channels: int) -> Classifier:
    """Move the network's final Linear (at ``classifier_slot``) into a Classifier head and adapt the stem."""
    slot = network.get_submodule(classifier_slot)
    linears = [m for m in slot.modules() if isinstance(m, nn.Linear)]
    dropouts = [m.p for m in slot.modules() if isinstance(m, nn.Dropout)]
    network.set_submodule(classifier_slot, nn.Identity())
    if in_channels != 3:
        _replace_input_conv(network, in_channels)
    return Classifier(network, linears[-1], drop_rate=dropouts[-1] if dropouts else 0.0)


def _replace_input_conv(network: nn.Module, in_channels: int) -> None:
    """Swap the first Conv2d for a new one reading ``in_channels`` channels, same geometry otherwise."""
    name, conv = next((n, m) for n, m in network.named_modules() if isinstance(m, nn.Conv2d))
    replacement = nn.Conv2d(
        in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        bias=conv.bias is not None,
    )
    network.set_submodule(name, replacement)


def _build(factory: str, classifier_slot: str, num_classes: int, in_channels: int) -> Classifier:
    """torchvision's ``models.<factory>`` without weights, behind the Classifier interface."""
    import torchvision  # imported here: torchvision is slow to import, and listing models must stay fast

    network: nn.Module = getattr(torchvision.models, factory)(weights=None, num_classes=num_classes)
    return _to_classifier(network, classifier_slot, in_channels)


@register_model("resnet18")
def resnet18(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ResNet-18, 512 features.

    References:
        He et al., Deep Residual Learning for Image Recognition, CVPR 2016.
    """
    return _build("resnet18", "fc", num_classes, in_channels)


@register_model("resnet50")
def resnet50(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ResNet-50, 2048 features.

    References:
        He et al., Deep Residual Learning for Image Recognition, CVPR 2016.
    """
    return _build("resnet50", "fc", num_classes, in_channels)


@register_model("mobilenet_v2")
def mobilenet_v2(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """MobileNetV2 (width 1.0), 1280 features, dropout 0.2 before the head.

    References:
        Sandler et al., MobileNetV2: Inverted Residuals and Linear Bottlenecks, CVPR 2018.
    """
    return _build("mobilenet_v2", "classifier", num_classes, in_channels)


@register_model("shufflenet")
def shufflenet(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ShuffleNetV2 x1.0, 1024 features (MDH-FL's ShuffleNetG2 stand-in: a V2 network, global pooling).

    References:
        Ma et al., ShuffleNet V2: Practical Guidelines for Efficient CNN Architecture Design, ECCV 2018.
    """
    return _build("shufflenet_v2_x1_0", "fc", num_classes, in_channels)


@register_model("efficientnet_b0")
def efficientnet_b0(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """EfficientNet-B0 in torchvision's layout (the one FCA uses), 1280 features, dropout 0.2 before the head.

    References:
        Tan and Le, EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks, ICML 2019.
    """
    return _build("efficientnet_b0", "classifier", num_classes, in_channels)


@register_model("densenet121")
def densenet121(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """DenseNet-121 in torchvision's layout (the one FedLSM uses), 1024 features.

    The 2x2 average pools of the three transition layers use ``ceil_mode=True``. With even feature maps (any
    input whose side is a multiple of 32, e.g. 224) the output is identical to torchvision's; with 28x28 inputs
    the last transition would otherwise receive a 1x1 map and fail.

    References:
        Huang et al., Densely Connected Convolutional Networks, CVPR 2017.
    """
    model = _build("densenet121", "classifier", num_classes, in_channels)
    for module in model.backbone.modules():
        if isinstance(module, nn.AvgPool2d):
            module.ceil_mode = True
    return model
