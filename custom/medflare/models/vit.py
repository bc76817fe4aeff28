"""Vision Transformer (timm) with the patch size chosen for the input size, so small images give enough tokens."""

from __future__ import annotations

import timm

from medflare.errors import ConfigError
from medflare.models._registry import register_model
from medflare.models.classifier import Classifier

__all__ = ["vit_patch_size", "vit_tiny"]

_PATCH_SIZES = (16, 8, 4, 2)
_MIN_PATCHES_PER_SIDE = 7


def vit_patch_size(image_size: int) -> int:
    """Largest patch size in (16, 8, 4, 2) that divides ``image_size`` into at least 7 patches per side.

    224 px gives 16 (the standard 14x14 grid), 64 px gives 8, 28 and 32 px give 4.

    Raises:
        ConfigError: if no patch size fits.
    """
    for patch in _PATCH_SIZES:
        if image_size % patch == 0 and image_size // patch >= _MIN_PATCHES_PER_SIDE:
            return patch
    raise ConfigError(
        f"image_size {image_size} has no ViT patch size in {_PATCH_SIZES} that divides it into at least "
        f"{_MIN_PATCHES_PER_SIDE} patches per side; resize the images (e.g. to 28, 32, 64 or 224)"
    )


@register_model("vit_tiny")
def vit_tiny(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ViT-Tiny (192-d, depth 12, 3 heads, class-token pooling) for ``image_size`` x ``image_size`` inputs only.

    The patch size follows :func:`vit_patch_size`; the position embeddings are sized for that grid, so other
    input sizes are rejected by timm.

    References:
        Dosovitskiy et al., An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale, ICLR 2021;
        Touvron et al., Training data-efficient image transformers & distillation through attention, ICML 2021.
    """
    network = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        num_classes=num_classes,
        in_chans=in_channels,
        img_size=image_size,
        patch_size=vit_patch_size(image_size),
    )
    head = network.get_classifier()
    network.reset_classifier(0)
    return Classifier(network, head)
