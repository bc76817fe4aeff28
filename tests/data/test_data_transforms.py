"""`build_transform`: shapes, dtype, range, resizing, determinism and input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medflare.data import build_transform
from medflare.errors import ConfigError, DataError


@pytest.mark.parametrize("channels, in_size, out_size, train, augment", [
    (1, 28, 28, False, "basic"),
    (3, 28, 64, True, "basic"),
    (3, 100, 32, True, "strong"),
    (1, 17, 24, True, "none"),
])
def test_transform_gives_normalised_float_chw(channels: int, in_size: int, out_size: int, train: bool,
                                              augment: str) -> None:
    """uint8 HWC of any size becomes float32 [C, S, S] in [-1, 1]."""
    # Prepare
    image = np.random.default_rng(0).integers(0, 256, (in_size, in_size, channels), dtype=np.uint8)

    # Execute
    tensor = build_transform(channels, out_size, train=train, augment=augment)(image)

    # Assert
    assert tensor.shape == (channels, out_size, out_size) and tensor.dtype == torch.float32
    assert tensor.min() >= -1.0 and tensor.max() <= 1.0


def test_eval_transform_is_deterministic_and_exact_at_native_size() -> None:
    """Without augmentation at native size the transform is exactly (x/255 - 0.5)/0.5."""
    # Prepare
    image = np.random.default_rng(1).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    transform = build_transform(3, 28, train=False)

    # Execute
    first, second = transform(image), transform(image)

    # Assert
    expected = torch.from_numpy(image).permute(2, 0, 1).float() / 255.0 * 2.0 - 1.0
    torch.testing.assert_close(first, expected)
    assert torch.equal(first, second)


def test_train_transform_augments() -> None:
    """Training transforms are random: repeated calls on one image differ."""
    # Prepare
    image = np.random.default_rng(2).integers(0, 256, (28, 28, 1), dtype=np.uint8)
    transform = build_transform(1, 28, train=True)
    torch.manual_seed(0)

    # Execute
    outputs = [transform(image) for _ in range(6)]

    # Assert
    assert any(not torch.equal(outputs[0], other) for other in outputs[1:])


def test_grayscale_2d_input_is_accepted() -> None:
    """An [H, W] array counts as one channel."""
    tensor = build_transform(1, 16, train=False)(np.zeros((8, 8), dtype=np.uint8))
    assert tensor.shape == (1, 16, 16)


def test_wrong_input_and_bad_options_raise() -> None:
    """Channel mismatch → DataError; unknown augmentation → ConfigError."""
    with pytest.raises(DataError, match=r"expects uint8 or float32 \[H, W, 3\]"):
        build_transform(3, 28, train=False)(np.zeros((28, 28, 1), dtype=np.uint8))
    with pytest.raises(ConfigError, match="none, weak, basic, strong"):
        build_transform(3, 28, train=True, augment="extreme")
