"""The LDAM-DRW network: the registered classifier with its linear head swapped for a cosine head."""

from __future__ import annotations

from typing import Any

from torch import nn

from medflare.errors import ConfigError
from medflare.methods.base import default_model_builder
from medflare.models import Classifier, CosineLinear

__all__ = ["build_cosine_head_model"]


def build_cosine_head_model(model: str, num_classes: int, in_channels: int, image_size: int, pretrained: str | None,
                            method_cfg: Any) -> nn.Module:
    """The registered model with ``head`` replaced by a :class:`CosineLinear` of the same shape. Site and server both
    build the network here, so they agree on the keys: the head keeps its name (``head.weight``) and has no bias,
    because LDAM's margins assume logits in [-1, 1]. Pretrained weights, if any, are loaded before the swap, so only the
    backbone keeps them. A factory network that is not a :class:`Classifier` (no replaceable head) is refused."""
    classifier = default_model_builder(model, num_classes, in_channels, image_size, pretrained, method_cfg)
    if not isinstance(classifier, Classifier):
        raise ConfigError(f"ldam-drw needs a Classifier with a replaceable head; '{model}' is {type(classifier)}")
    linear = classifier.head
    classifier.head = CosineLinear(classifier.num_features, classifier.num_classes).to(
        device=linear.weight.device, dtype=linear.weight.dtype
    )
    return classifier
