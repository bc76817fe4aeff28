"""Vision Transformers (timm) from a CPU-sized ViT-Tiny at 28 px up to ViT-B/16 at 224 px, all from one builder.

Every size pools by the mean of the patch tokens followed by a LayerNorm (``fc_norm``), as MAE/BEiT fine-tuning
does (SSL-FL, spec §4(a)); the class token is kept (a MAE encoder has one) but not pooled. The patch size is
chosen from the image size so small images still give a 7x7 grid or finer. Nothing is downloaded.
"""

from __future__ import annotations

from medflare.errors import ConfigError
from medflare.models._registry import register_model
from medflare.models.classifier import Classifier

__all__ = [
    "VIT_SIZES", "VitClassifier", "build_vit", "vit_base", "vit_micro", "vit_patch_size", "vit_size", "vit_small",
    "vit_tiny",
]

#: size -> (embedding width, depth, attention heads), the ViT/DeiT standard sizes.
#: "micro" is not a standard size: a CPU benchmark ViT (96-d, depth 6) for 28 px runs on shared cores.
VIT_SIZES = {"micro": (96, 6, 3), "tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12)}
_PATCH_SIZES = (16, 8, 4, 2)
_MIN_PATCHES_PER_SIDE = 7


def vit_size(model: str) -> str:
    """The :data:`VIT_SIZES` key of a ViT model name ("vit_tiny" -> "tiny").

    Raises:
        ConfigError: a name that is not one of the ``vit_*`` models.
    """
    size = model.removeprefix("vit_")
    if not model.startswith("vit_") or size not in VIT_SIZES:
        raise ConfigError(f"'{model}' is not a ViT; choose one of {', '.join('vit_' + s for s in VIT_SIZES)}")
    return size


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


class VitClassifier(Classifier):
    """A Classifier over a timm VisionTransformer that declares its layers for layer-wise lr decay.

    timm's ``param_groups_layer_decay`` reads :meth:`group_matcher`: patch embedding, class token and position
    embedding form layer 0, block ``i`` is layer ``i + 1``, and ``fc_norm`` and the head the last layer.
    """

    def group_matcher(self, coarse: bool = False) -> dict:
        """Regexes over this model's parameter names, in timm's ``group_matcher`` format."""
        return {
            "stem": r"^backbone\.(?:cls_token|reg_token|pos_embed|patch_embed|norm_pre)",
            "blocks": [(r"^backbone\.blocks\.(\d+)", None), (r"^backbone\.norm\.", (99999,))],
        }

    def no_weight_decay(self) -> set[str]:
        """Parameter names that take no weight decay when norms and biases take none (position embedding, tokens)."""
        return {f"backbone.{name}" for name in self.backbone.no_weight_decay()}


def build_vit(
    size: str,
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    patch_size: int | None = None,
    drop_path_rate: float = 0.0,
    layer_scale: float | None = None,
) -> VitClassifier:
    """A randomly initialised ViT of a standard size for ``image_size`` x ``image_size`` inputs only.

    Args:
        size: a key of :data:`VIT_SIZES`.
        num_classes: width of the head.
        in_channels: image channels.
        image_size: input side; the position embeddings are sized for its patch grid.
        patch_size: patch side; default :func:`vit_patch_size` of ``image_size``.
        drop_path_rate: stochastic depth rate (MAE fine-tuning uses 0.1, BEiT 0.2).
        layer_scale: initial value of per-channel residual scales (BEiT: 0.1); None = no layer scale.

    Raises:
        ConfigError: unknown size, or a patch size that does not tile the image.
    """
    if size not in VIT_SIZES:
        raise ConfigError(f"unknown ViT size '{size}'; choose one of {', '.join(VIT_SIZES)}")
    patch = patch_size or vit_patch_size(image_size)
    if image_size % patch:
        raise ConfigError(f"ViT patch size {patch} does not divide image_size {image_size}; pick a divisor")
    width, depth, heads = VIT_SIZES[size]
    from timm.models.vision_transformer import VisionTransformer  # here: timm is slow to import

    network = VisionTransformer(
        img_size=image_size,
        patch_size=patch,
        in_chans=in_channels,
        num_classes=num_classes,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
        global_pool="avg",
        fc_norm=True,
        drop_path_rate=drop_path_rate,
        init_values=layer_scale,
    )
    head = network.get_classifier()
    network.reset_classifier(0)
    return VitClassifier(network, head)


@register_model("vit_micro")
def vit_micro(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ViT-Micro (96-d, depth 6, 3 heads, about 0.7M parameters): ViT-Tiny's heads at half the width and depth, for
    CPU benchmarks at 28 px (about 8x cheaper per step than ViT-Tiny).

    References:
        Dosovitskiy et al., An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale, ICLR 2021.
    """
    return build_vit("micro", num_classes=num_classes, in_channels=in_channels, image_size=image_size)


@register_model("vit_tiny")
def vit_tiny(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ViT-Tiny (192-d, depth 12, 3 heads, about 5.5M parameters): the CPU-sized ViT, e.g. 4-px patches at 28 px.

    References:
        Dosovitskiy et al., An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale, ICLR 2021;
        Touvron et al., Training data-efficient image transformers & distillation through attention, ICML 2021.
    """
    return build_vit("tiny", num_classes=num_classes, in_channels=in_channels, image_size=image_size)


@register_model("vit_small")
def vit_small(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ViT-Small (384-d, depth 12, 6 heads, about 22M parameters).

    References:
        Touvron et al., Training data-efficient image transformers & distillation through attention, ICML 2021.
    """
    return build_vit("small", num_classes=num_classes, in_channels=in_channels, image_size=image_size)


@register_model("vit_base")
def vit_base(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """ViT-Base (768-d, depth 12, 12 heads, about 86M parameters): ViT-B/16 at 224 px, the SSL-FL encoder.

    References:
        Dosovitskiy et al., An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale, ICLR 2021.
    """
    return build_vit("base", num_classes=num_classes, in_channels=in_channels, image_size=image_size)
