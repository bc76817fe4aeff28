"""Vision Transformers (timm) from a CPU-sized ViT-Tiny at 28 px up to ViT-B/16 at 224 px, all from one builder.

Every size pools by the mean of the patch tokens followed by a LayerNorm (``fc_norm``), as MAE/BEiT fine-tuning
does (SSL-FL, spec §4(a)); the class token is kept (a MAE encoder has one) but not pooled. The patch size is
chosen from the image size so small images still give a 7x7 grid or finer. Nothing is downloaded.
"""

from __future__ import annotations

from medflare.errors import ConfigError
from medflare.models._registry import ModelEntrypoint, register_model
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
    """The :data:`VIT_SIZES` key of a ViT model name ("vit_tiny" -> "tiny"); ConfigError for another name."""
    size = model.removeprefix("vit_")
    if not model.startswith("vit_") or size not in VIT_SIZES:
        raise ConfigError(f"'{model}' is not a ViT; choose one of {', '.join('vit_' + s for s in VIT_SIZES)}")
    return size


def vit_patch_size(image_size: int) -> int:
    """Largest patch size in (16, 8, 4, 2) that divides ``image_size`` into at least 7 patches per side (224 px:
    16, 64 px: 8, 28 and 32 px: 4); ConfigError if none fits."""
    for patch in _PATCH_SIZES:
        if image_size % patch == 0 and image_size // patch >= _MIN_PATCHES_PER_SIDE:
            return patch
    raise ConfigError(
        f"image_size {image_size} has no ViT patch size in {_PATCH_SIZES} that divides it into at least "
        f"{_MIN_PATCHES_PER_SIDE} patches per side; resize the images (e.g. to 28, 32, 64 or 224)"
    )


class VitClassifier(Classifier):
    """A Classifier over a timm VisionTransformer that declares its layers for layer-wise lr decay (timm reads
    :meth:`group_matcher`: the stem is layer 0, block ``i`` layer ``i + 1``, ``fc_norm`` and the head the last)."""

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
    """A randomly initialised ViT of a :data:`VIT_SIZES` size for ``image_size`` x ``image_size`` inputs only;
    ``drop_path_rate``: stochastic depth (MAE fine-tuning 0.1, BEiT 0.2); ``layer_scale``: initial per-channel
    residual scale (BEiT: 0.1; None = none). ConfigError for an unknown size or a patch that does not tile."""
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


def _register_vit(size: str, summary: str) -> ModelEntrypoint:
    """Register ``vit_<size>``: :func:`build_vit` of that size, described by ``summary``."""

    def build(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
        return build_vit(size, num_classes=num_classes, in_channels=in_channels, image_size=image_size)

    build.__name__ = build.__qualname__ = f"vit_{size}"
    build.__doc__ = summary
    return register_model(f"vit_{size}")(build)


# Dosovitskiy et al., An Image is Worth 16x16 Words, ICLR 2021; Touvron et al. (DeiT), ICML 2021
vit_micro = _register_vit("micro", "ViT-Micro (96-d, depth 6, 3 heads, ~0.7M parameters): ViT-Tiny's heads at half "
                                   "the width and depth, for CPU benchmarks at 28 px (~8x cheaper per step).")
vit_tiny = _register_vit("tiny", "ViT-Tiny (192-d, depth 12, 3 heads, ~5.5M parameters): the CPU-sized ViT.")
vit_small = _register_vit("small", "ViT-Small (384-d, depth 12, 6 heads, ~22M parameters).")
vit_base = _register_vit("base", "ViT-Base (768-d, depth 12, 12 heads, ~86M parameters): ViT-B/16 at 224 px, "
                                 "the SSL-FL encoder.")
