"""torchvision classification networks behind the Classifier interface, built with ``weights=None`` (nothing
is downloaded) and the requested class count: the library's final Linear (and its dropout) becomes the head, its
classifier slot an identity. For ``in_channels != 3`` the stem is a freshly initialised convolution of the same
geometry. All accept 28x28 inputs (DenseNet-121 with one change, see :func:`densenet121`).
"""

from __future__ import annotations

from torch import nn

from medflare.models._registry import ModelEntrypoint, register_model
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


def _register(name: str, factory: str, classifier_slot: str, summary: str) -> ModelEntrypoint:
    """Register ``name``: torchvision's ``models.<factory>`` with its classifier at ``classifier_slot``."""

    def build(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
        return _build(factory, classifier_slot, num_classes, in_channels)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = summary
    return register_model(name)(build)


# He et al., CVPR 2016; Sandler et al., CVPR 2018; Ma et al., ECCV 2018; Tan and Le, ICML 2019
resnet18 = _register("resnet18", "resnet18", "fc", "ResNet-18, 512 features.")
resnet50 = _register("resnet50", "resnet50", "fc", "ResNet-50, 2048 features.")
mobilenet_v2 = _register("mobilenet_v2", "mobilenet_v2", "classifier",
                         "MobileNetV2 (width 1.0), 1280 features, dropout 0.2 before the head.")
shufflenet = _register("shufflenet", "shufflenet_v2_x1_0", "fc",
                       "ShuffleNetV2 x1.0, 1024 features (MDH-FL's ShuffleNetG2 stand-in: a V2 network).")
efficientnet_b0 = _register("efficientnet_b0", "efficientnet_b0", "classifier",
                            "EfficientNet-B0 in torchvision's layout (FCA's), 1280 features, dropout 0.2.")


@register_model("densenet121")
def densenet121(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """DenseNet-121 in torchvision's layout (FedLSM's; Huang et al., CVPR 2017), 1024 features. The transition
    pools use ``ceil_mode=True``: identical output for sides that are multiples of 32, and 28x28 inputs no longer
    hand the last transition a 1x1 map."""
    model = _build("densenet121", "classifier", num_classes, in_channels)
    for module in model.backbone.modules():
        if isinstance(module, nn.AvgPool2d):
            module.ceil_mode = True
    return model
