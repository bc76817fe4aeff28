"""``create_model``: name -> randomly initialised or pretrained Classifier."""

from __future__ import annotations

import os

from medflare.errors import ConfigError
from medflare.models._registry import get_model_info, list_models
from medflare.models.classifier import Classifier
from medflare.models.weights import load_weights

__all__ = ["IMAGENET", "create_model"]

#: The ``pretrained`` value that asks for the model's offline ImageNet weights.
IMAGENET = "imagenet"


def create_model(
    name: str,
    num_classes: int,
    in_channels: int = 3,
    *,
    pretrained: str | os.PathLike[str] | None = None,
    image_size: int = 28,
) -> Classifier:
    """Build a registered model.

    Args:
        name: a name from :func:`list_models`.
        num_classes: width of the head.
        in_channels: image channels (1 for greyscale, 3 for RGB, or more).
        pretrained: None for random initialisation; ``"imagenet"`` for the offline ImageNet weights (only
            ``efficientnet_lite0`` has them); or the path of a local weights file, see
            :func:`medflare.models.weights.load_weights` for the accepted layouts.
        image_size: side of the square input images. Only models whose architecture depends on it use it
            (the ``vit_*`` models size their patches and position embeddings for it); the convolutional networks
            accept any input size from 28x28 up (every registered model is tested at 28x28).

    Raises:
        ConfigError: for an unknown name, non-positive sizes, ``"imagenet"`` on a model without offline weights, or
            an entry function that returns something other than a :class:`Classifier`.
        DataError: if a weights file is missing or does not fit the model.
    """
    info = get_model_info(name)
    for label, value in (("num_classes", num_classes), ("in_channels", in_channels), ("image_size", image_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"create_model('{name}'): {label} must be a positive integer, got {value!r}")
    model = info.entrypoint(num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    if not isinstance(model, Classifier):  # methods split every model into backbone and head (a user's model too)
        raise ConfigError(f"model '{name}' ({info.module}) returned a {type(model).__name__}, not a medflare "
                          "Classifier; wrap the network: Classifier(backbone, head), see docs/own-model-and-data.md")
    if pretrained is None:
        return model
    if pretrained == IMAGENET:
        if info.imagenet_weights is None:
            offline = [n for n in list_models() if get_model_info(n).imagenet_weights is not None]
            raise ConfigError(
                f"model '{name}' has no offline ImageNet weights (only {', '.join(offline)} ships them, and nothing "
                "is downloaded); pass the path of a local weights file as pretrained=... instead"
            )
        load_weights(model, info.imagenet_weights(), source=f"ImageNet weights of '{name}'")
    else:
        load_weights(model, pretrained)
    return model
