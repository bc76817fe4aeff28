"""Image transforms: `[H, W, C]` numpy arrays (uint8, or float32 in [0, 1]) to float32 `[C, S, S]` tensors
normalised to [-1, 1] (mean = std = 0.5: data-set agnostic, so sites share no statistics). Training augmentations
are named recipes (the method-specific ones follow the papers' code, spec §4(c), §5(c)); every draw comes from
torch's global generator, so a site's (and a DataLoader worker's) seed fixes the views.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from medflare.errors import ConfigError, DataError

AUGMENTATIONS = ("none", "weak", "basic", "strong", "fedlsm_strong", "mae_pretrain", "beit_pretrain", "ssl_finetune")
NORMALISE_MEAN = 0.5
NORMALISE_STD = 0.5
#: FedLSM's GaussNoise(var_limit=(5, 30)) is a variance on the 0-255 pixel scale; the noise is added here to [0, 1]
#: pixels, so its std is sqrt(var) / 255 = 0.0088-0.0215 (0.0175-0.043 after the 0.5/0.5 normalisation).
FEDLSM_NOISE_VAR = (5.0, 30.0)


class ImageTransform:
    """A built transform: call it on an `[H, W, C]` or `[H, W]` image; `augment` and `pipeline` say what it does."""

    def __init__(self, pipeline: Callable[[torch.Tensor], torch.Tensor], channels: int, augment: str) -> None:
        self.pipeline = pipeline
        self.channels = channels
        self.augment = augment

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        return self.pipeline(_to_chw_tensor(image, self.channels))

    def __repr__(self) -> str:
        return f"ImageTransform(augment={self.augment!r}, {self.pipeline!r})"


def build_transform(channels: int, image_size: int, train: bool, augment: str = "basic") -> ImageTransform:
    """The per-sample transform: uint8 (scaled by 1/255) or [0, 1] float32 `[H, W, C]` (or `[H, W]`) images with
    `channels` (1 or 3) to float32 `[C, image_size, image_size]`, with the `augment` recipe when `train` (see
    :func:`augmentation_steps`); ConfigError for an unknown recipe or bad sizes."""
    from torchvision.transforms import v2  # here: torchvision pulls in torch._dynamo, seconds of CPU per process

    if augment not in AUGMENTATIONS:
        raise ConfigError(f"Unknown augmentation '{augment}'; use one of {', '.join(AUGMENTATIONS)}.")
    if channels not in (1, 3) or image_size < 1:
        raise ConfigError(f"Transform needs channels in (1, 3) and image_size >= 1, got {channels}, {image_size}.")
    steps = augmentation_steps(augment if train else "none", channels, image_size)
    steps += [
        v2.ToDtype(torch.float32, scale=True),  # a no-op where a recipe already works on [0, 1] floats
        v2.Normalize(mean=[NORMALISE_MEAN] * channels, std=[NORMALISE_STD] * channels),
    ]
    return ImageTransform(v2.Compose(steps), channels, augment if train else "none")


def augmentation_steps(augment: str, channels: int, image_size: int) -> list[Callable]:
    """The steps of one recipe on a `[C, H, W]` uint8 (or [0, 1] float) tensor, ending at `image_size` squared.

    - ``none``: resize only. ``weak``: + horizontal flip (FixMatch's and FedLSM's weak view: Resize + H-flip).
    - ``basic``: + small affine (±10°, 5 % shift, scale 0.95-1.05). ``strong``: basic + vertical flip,
      brightness/contrast jitter 0.2 and Gaussian blur (kernel 3, p 0.5).
    - ``fedlsm_strong``: the FedLSM code's strong view (albumentations 1.1.0, spec §5(c)): V-flip 0.5, H-flip 0.5,
      RandomBrightness ±0.2 additive (p 0.75), one of {MedianBlur 3|5, GaussianBlur 3|5, GaussNoise var 5-30}
      (p 0.7), ShiftScaleRotate (shift 0.1, scale 0.1, rotate 15°, constant black border, p 0.85).
    - ``mae_pretrain``: Fed-MAE's Retina pre-training (spec §4(c)): RandomResizedCrop scale 0.2-1 bicubic,
      RandomGrayscale 0.2 (3 channels only: a no-op on grayscale), ColorJitter(0.4, 0.4, 0.4), H-flip.
    - ``beit_pretrain``: Fed-BEiT's Retina pre-training: the same ops in BEiT's order (grayscale, jitter, flip,
      then the crop); the tokenizer sees the same view (no second 112-px lanczos view: it tokenises the input).
    - ``ssl_finetune``: SSL-FL fine-tuning: RandomResizedCrop scale 0.6-1 (bilinear), RandomRotation 10°, H-flip.

    Raises:
        ConfigError: Unknown `augment`.
    """
    from torchvision.transforms import v2

    if augment not in AUGMENTATIONS:
        raise ConfigError(f"Unknown augmentation '{augment}'; use one of {', '.join(AUGMENTATIONS)}.")
    size = (image_size, image_size)
    resize = v2.Resize(size, antialias=True)
    if augment == "none":
        return [resize]
    if augment == "weak":
        return [resize, v2.RandomHorizontalFlip()]
    if augment in ("basic", "strong"):
        steps: list[Callable] = [
            resize, v2.RandomHorizontalFlip(), v2.RandomAffine(degrees=10, translate=(0.05, 0.05), scale=(0.95, 1.05)),
        ]
        if augment == "strong":
            steps += [
                v2.RandomVerticalFlip(),
                v2.ColorJitter(brightness=0.2, contrast=0.2),
                v2.RandomApply([v2.GaussianBlur(kernel_size=3, sigma=(0.1, 1.0))], p=0.5),
            ]
        return steps
    if augment == "fedlsm_strong":
        return [resize, v2.ToDtype(torch.float32, scale=True), *_fedlsm_strong(v2)]
    if augment == "ssl_finetune":
        return [
            v2.RandomResizedCrop(size, scale=(0.6, 1.0), interpolation=v2.InterpolationMode.BILINEAR, antialias=True),
            v2.RandomRotation(degrees=10, interpolation=v2.InterpolationMode.NEAREST),  # torchvision's default
            v2.RandomHorizontalFlip(),
        ]
    crop = v2.RandomResizedCrop(size, scale=(0.2, 1.0), interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    colour = [v2.RandomGrayscale(p=0.2)] if channels == 3 else []
    colour.append(v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4))
    if augment == "mae_pretrain":
        return [crop, *colour, v2.RandomHorizontalFlip()]
    return [*colour, v2.RandomHorizontalFlip(), crop]  # beit_pretrain


def _fedlsm_strong(v2: Any) -> list[Callable]:
    """FedLSM's strong view after Resize, on [0, 1] floats (``SrongAugmentedSubset`` in the authors' code).

    albumentations 1.1.0 semantics: MedianBlur(blur_limit=5) draws kernel 3 or 5; GaussianBlur(blur_limit=5)
    draws kernel 3 (1/3) or 5 (2/3) with OpenCV's sigma for that kernel (0.8, 1.1); OneOf picks one uniformly;
    ShiftScaleRotate uses bilinear interpolation and a constant 0 border.
    """
    blur_or_noise = v2.RandomChoice([
        v2.RandomChoice([MedianBlur(3), MedianBlur(5)]),
        v2.RandomChoice([v2.GaussianBlur(kernel_size=3, sigma=0.8), v2.GaussianBlur(kernel_size=5, sigma=1.1)],
                        p=[1 / 3, 2 / 3]),
        GaussNoise(FEDLSM_NOISE_VAR),
    ])
    return [
        v2.RandomVerticalFlip(p=0.5),
        v2.RandomHorizontalFlip(p=0.5),
        v2.RandomApply([BrightnessShift(0.2)], p=0.75),
        v2.RandomApply([blur_or_noise], p=0.7),
        v2.RandomApply([v2.RandomAffine(degrees=15, translate=(0.1, 0.1), scale=(0.9, 1.1),
                                        interpolation=v2.InterpolationMode.BILINEAR, fill=0)], p=0.85),
    ]


class BrightnessShift:
    """albumentations' RandomBrightness(limit) (``brightness_by_max``): add one offset ~ U(-limit, limit) to every
    pixel of a [0, 1] float image, then clip. torchvision's brightness is a factor instead, hence this class."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        offset = torch.empty(()).uniform_(-self.limit, self.limit)
        return (image + offset).clamp_(0.0, 1.0)

    def __repr__(self) -> str:
        return f"BrightnessShift(limit={self.limit})"


class GaussNoise:
    """albumentations' GaussNoise(var_limit): zero-mean noise per pixel and channel whose variance is drawn per
    image from ``var_limit`` on the 0-255 scale; on [0, 1] floats its std is sqrt(var) / 255 (torchvision's
    ``gaussian_noise`` adds it and clips to [0, 1]; its ``GaussianNoise`` only takes a fixed sigma)."""

    def __init__(self, var_limit: tuple[float, float]) -> None:
        self.var_limit = var_limit

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.v2.functional import gaussian_noise

        variance = float(torch.empty(()).uniform_(*self.var_limit))
        return gaussian_noise(image, mean=0.0, sigma=math.sqrt(variance) / 255.0, clip=True)

    def __repr__(self) -> str:
        return f"GaussNoise(var_limit={self.var_limit} on 0-255)"


class MedianBlur:
    """A `kernel_size` squared median filter per channel with replicated borders (OpenCV's medianBlur), by MONAI."""

    def __init__(self, kernel_size: int) -> None:
        self.kernel_size = kernel_size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        from monai.networks.layers import median_filter  # MONAI takes seconds to import: only when first drawn

        return median_filter(image, kernel_size=self.kernel_size, spatial_dims=2)

    def __repr__(self) -> str:
        return f"MedianBlur(kernel_size={self.kernel_size})"


def _to_chw_tensor(image: np.ndarray, channels: int) -> torch.Tensor:
    """`[H, W]` / `[H, W, C]` numpy array to a `[C, H, W]` tensor of the same dtype, checking the channel count."""
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[-1] != channels or image.dtype not in (np.uint8, np.float32):
        raise DataError(
            f"Transform expects uint8 or float32 [H, W, {channels}] images, got {image.dtype} {image.shape}; "
            "check the source's channel count."
        )
    # The copy makes the tensor own writable memory (cached sources are read-only).
    return torch.from_numpy(np.array(image.transpose(2, 0, 1)))
