"""The method recipes of `build_transform`: SSL-FL's pre-training and fine-tuning views (spec §4(c)) and FedLSM's
strong view (spec §5(c)), op by op with their parameters, their numeric behaviour, and their determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import ndimage
from torchvision.transforms import v2

from medflare.data.transforms import (
    AUGMENTATIONS,
    FEDLSM_NOISE_VAR,
    BrightnessShift,
    GaussNoise,
    MedianBlur,
    augmentation_steps,
    build_transform,
)

BICUBIC, BILINEAR, NEAREST = (v2.InterpolationMode.BICUBIC, v2.InterpolationMode.BILINEAR,
                              v2.InterpolationMode.NEAREST)
JITTER_04 = (0.6, 1.4)  # ColorJitter(0.4) draws each factor from [1 - 0.4, 1 + 0.4]


def _kinds(steps: list) -> list[type]:
    return [type(step) for step in steps]


def _crop(step: v2.RandomResizedCrop, scale: tuple[float, float], interpolation: v2.InterpolationMode) -> None:
    assert isinstance(step, v2.RandomResizedCrop)
    assert tuple(step.size) == (28, 28) and tuple(step.scale) == scale and step.interpolation == interpolation
    assert tuple(step.ratio) == pytest.approx((3 / 4, 4 / 3))  # torchvision's default, as the scripts use


def _jitter(step: v2.ColorJitter) -> None:
    assert isinstance(step, v2.ColorJitter)
    assert (tuple(step.brightness), tuple(step.contrast), tuple(step.saturation), step.hue) == (
        JITTER_04, JITTER_04, JITTER_04, None)


def test_mae_pretraining_is_crop_02_bicubic_then_grayscale_jitter_04_and_flip() -> None:
    """MAE's Retina recipe: RandomResizedCrop(scale 0.2-1, bicubic), RandomGrayscale 0.2, ColorJitter 0.4, H-flip."""
    steps = augmentation_steps("mae_pretrain", channels=3, image_size=28)
    assert _kinds(steps) == [v2.RandomResizedCrop, v2.RandomGrayscale, v2.ColorJitter, v2.RandomHorizontalFlip]
    _crop(steps[0], (0.2, 1.0), BICUBIC)
    assert steps[1].p == 0.2 and steps[3].p == 0.5
    _jitter(steps[2])
    # grayscale images: RandomGrayscale would do nothing, so it is left out
    assert _kinds(augmentation_steps("mae_pretrain", 1, 28)) == [v2.RandomResizedCrop, v2.ColorJitter,
                                                                 v2.RandomHorizontalFlip]


def test_beit_pretraining_is_the_same_ops_in_beits_order_crop_last() -> None:
    steps = augmentation_steps("beit_pretrain", channels=3, image_size=28)
    assert _kinds(steps) == [v2.RandomGrayscale, v2.ColorJitter, v2.RandomHorizontalFlip, v2.RandomResizedCrop]
    assert steps[0].p == 0.2
    _jitter(steps[1])
    _crop(steps[3], (0.2, 1.0), BICUBIC)


def test_ssl_finetuning_is_crop_06_rotation_10_and_flip() -> None:
    steps = augmentation_steps("ssl_finetune", channels=1, image_size=28)
    assert _kinds(steps) == [v2.RandomResizedCrop, v2.RandomRotation, v2.RandomHorizontalFlip]
    _crop(steps[0], (0.6, 1.0), BILINEAR)
    assert list(steps[1].degrees) == [-10.0, 10.0] and steps[1].interpolation == NEAREST


def test_fedlsm_strong_view_is_the_codes_albumentations_pipeline() -> None:
    """Resize, V-flip 0.5, H-flip 0.5, brightness ±0.2 (p 0.75), one of {median 3|5, Gaussian blur 3|5, noise var
    5-30} (p 0.7), shift 0.1 / scale 0.1 / rotate 15° with a constant black border (p 0.85)."""
    steps = augmentation_steps("fedlsm_strong", channels=3, image_size=28)
    assert _kinds(steps) == [v2.Resize, v2.ToDtype, v2.RandomVerticalFlip, v2.RandomHorizontalFlip, v2.RandomApply,
                             v2.RandomApply, v2.RandomApply]
    resize, _, vflip, hflip, brightness, blur_or_noise, affine = steps
    assert tuple(resize.size) == (28, 28) and vflip.p == 0.5 and hflip.p == 0.5
    assert brightness.p == 0.75 and _kinds(brightness.transforms) == [BrightnessShift]
    assert brightness.transforms[0].limit == 0.2
    assert blur_or_noise.p == 0.7
    (choice,) = blur_or_noise.transforms
    median, gaussian, noise = choice.transforms
    assert choice.p == pytest.approx([1 / 3] * 3)
    assert [m.kernel_size for m in median.transforms] == [3, 5] and median.p == pytest.approx([0.5, 0.5])
    assert [(tuple(g.kernel_size), tuple(g.sigma)) for g in gaussian.transforms] == [((3, 3), (0.8, 0.8)),
                                                                                      ((5, 5), (1.1, 1.1))]
    assert gaussian.p == pytest.approx([1 / 3, 2 / 3])  # albumentations' GaussianBlur(blur_limit=5) draws
    assert isinstance(noise, GaussNoise) and noise.var_limit == FEDLSM_NOISE_VAR == (5.0, 30.0)
    assert affine.p == 0.85
    (shift_scale_rotate,) = affine.transforms
    assert isinstance(shift_scale_rotate, v2.RandomAffine)
    assert list(shift_scale_rotate.degrees) == [-15.0, 15.0] and tuple(shift_scale_rotate.translate) == (0.1, 0.1)
    assert tuple(shift_scale_rotate.scale) == (0.9, 1.1) and shift_scale_rotate.interpolation == BILINEAR
    assert shift_scale_rotate.fill == 0  # albumentations' border_mode=0: constant, value 0


def test_noise_std_is_the_square_root_of_a_0_255_variance_on_unit_pixels() -> None:
    """GaussNoise var 5-30 on the 0-255 scale: std sqrt(var)/255 on [0, 1] pixels (0.0088-0.0215), so 0.0175-0.043
    after the 0.5/0.5 normalisation."""
    torch.manual_seed(0)
    image = torch.full((1, 200, 200), 0.5)
    stds = torch.tensor([float((GaussNoise(FEDLSM_NOISE_VAR)(image) - 0.5).std()) for _ in range(200)])
    low, high = math.sqrt(5) / 255, math.sqrt(30) / 255
    assert low * 0.97 < float(stds.min()) < low * 1.1 and high * 0.9 < float(stds.max()) < high * 1.03
    variances = (stds * 255) ** 2  # drawn uniformly in [5, 30]: mean 17.5
    assert abs(float(variances.mean()) - 17.5) < 1.5


def test_brightness_adds_one_offset_within_the_limit_and_clips() -> None:
    torch.manual_seed(0)
    image = torch.linspace(0, 1, 101).reshape(1, 1, 101)
    offsets = []
    for _ in range(200):
        out = BrightnessShift(0.2)(image.clone())
        middle = out[0, 0, 30:70] - image[0, 0, 30:70]  # never clipped: one offset for every pixel
        assert torch.allclose(middle, middle[0].expand_as(middle), atol=1e-6)
        assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
        offsets.append(float(middle[0]))
    assert -0.2 <= min(offsets) < -0.18 and 0.18 < max(offsets) <= 0.2  # additive, uniform in ±0.2


@pytest.mark.parametrize("kernel", [3, 5])
def test_median_blur_is_a_median_filter_with_replicated_borders(kernel: int) -> None:
    image = torch.from_numpy(np.random.default_rng(0).random((3, 12, 12), dtype=np.float32))
    expected = ndimage.median_filter(image.numpy(), size=(1, kernel, kernel), mode="nearest")
    np.testing.assert_allclose(MedianBlur(kernel)(image).numpy(), expected)


@pytest.mark.parametrize("augment", AUGMENTATIONS)
@pytest.mark.parametrize("channels", [1, 3])
def test_every_recipe_gives_normalised_floats_at_the_image_size_and_repeats_under_one_seed(
        augment: str, channels: int) -> None:
    """Draws come from torch's generator only: one seed, the same views (a site's seed fixes its data)."""
    images = np.random.default_rng(3).integers(0, 256, (6, 32, 32, channels), dtype=np.uint8)
    transform = build_transform(channels, 28, train=True, augment=augment)

    def views(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return torch.stack([transform(image) for image in images for _ in range(4)])

    first, again, other = views(0), views(0), views(1)
    assert first.shape == (24, channels, 28, 28) and first.dtype == torch.float32
    assert float(first.min()) >= -1.0 and float(first.max()) <= 1.0
    assert torch.equal(first, again)
    assert augment == "none" or not torch.equal(first, other)
    assert transform.augment == augment
    assert build_transform(channels, 28, train=False, augment=augment).augment == "none"
