"""Image transforms: `[H, W, C]` numpy arrays (uint8, or float32 in [0, 1] for deeper images) to normalised
float32 `[C, S, S]` tensors.

Normalisation is mean 0.5 / std 0.5 per channel, i.e. pixels end up in [-1, 1]. It is data-set agnostic, so
every site normalises identically without sharing statistics; ImageNet-pretrained backbones cope with it when
fine-tuned (methods that need exact ImageNet statistics can build their own transform).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from medflare.errors import ConfigError, DataError

AUGMENTATIONS = ("none", "weak", "basic", "strong")
NORMALISE_MEAN = 0.5
NORMALISE_STD = 0.5


def build_transform(channels: int, image_size: int, train: bool,
                    augment: str = "basic") -> Callable[[np.ndarray], torch.Tensor]:
    """Builds the per-sample transform.

    Args:
        channels: Expected channels of the input (1 or 3); the output has the same number.
        image_size: Output height and width; inputs of another size are resized (bilinear, antialiased).
        train: Whether to add random augmentation; evaluation transforms are deterministic.
        augment: Training augmentation: "none"; "weak" = horizontal flip only (FixMatch/FedLSM's weak view);
            "basic" = horizontal flip + small affine (±10°, 5% shift, 0.95-1.05 scale); "strong" = basic +
            vertical flip, brightness/contrast jitter and Gaussian blur.

    Returns:
        A callable mapping uint8 or float32 `[H, W, C]` (or `[H, W]` grayscale) to float32
        `[C, image_size, image_size]`; uint8 is scaled by 1/255, float32 is taken as already in [0, 1].

    Raises:
        ConfigError: Unknown `augment`, or bad `channels`/`image_size`.
    """
    from torchvision.transforms import v2  # here: torchvision pulls in torch._dynamo, seconds of CPU per process

    if augment not in AUGMENTATIONS:
        raise ConfigError(f"Unknown augmentation '{augment}'; use one of {', '.join(AUGMENTATIONS)}.")
    if channels not in (1, 3) or image_size < 1:
        raise ConfigError(f"Transform needs channels in (1, 3) and image_size >= 1, got {channels}, {image_size}.")
    steps: list[Callable] = [v2.Resize((image_size, image_size), antialias=True)]
    if train and augment != "none":
        steps.append(v2.RandomHorizontalFlip())
    if train and augment in ("basic", "strong"):
        steps.append(v2.RandomAffine(degrees=10, translate=(0.05, 0.05), scale=(0.95, 1.05)))
    if train and augment == "strong":
        steps += [
            v2.RandomVerticalFlip(),
            v2.ColorJitter(brightness=0.2, contrast=0.2),
            v2.RandomApply([v2.GaussianBlur(kernel_size=3, sigma=(0.1, 1.0))], p=0.5),
        ]
    steps += [
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=[NORMALISE_MEAN] * channels, std=[NORMALISE_STD] * channels),
    ]
    pipeline = v2.Compose(steps)

    def transform(image: np.ndarray) -> torch.Tensor:
        return pipeline(_to_chw_tensor(image, channels))

    return transform


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
