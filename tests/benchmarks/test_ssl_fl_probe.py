"""The encoder probe tells informative features from collapsed ones."""

import numpy as np
import pytest
import torch

from tests.benchmarks.conftest import load_benchmark


@pytest.fixture(scope="module")
def probe_script():
    return load_benchmark("ssl_fl_probe")


def brightness_data(script, n: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Images whose label is whether they are bright: a feature of the mean pixel separates them."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    images = rng.integers(0, 100, (n, 28, 28)) + 120 * labels[:, None, None]
    return script.images_tensor(images.astype(np.uint8)), labels


class MeanPixel(torch.nn.Module):
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.mean(dim=(1, 2, 3))[:, None]


class Constant(torch.nn.Module):
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(images), 4)


def test_images_become_normalised_channel_first_tensors(probe_script) -> None:
    grey = probe_script.images_tensor(np.full((2, 28, 28), 255, np.uint8))
    rgb = probe_script.images_tensor(np.zeros((2, 28, 28, 3), np.uint8))
    assert grey.shape == (2, 1, 28, 28) and rgb.shape == (2, 3, 28, 28)
    assert grey.max().item() == pytest.approx(1.0) and rgb.min().item() == pytest.approx(-1.0)


def test_the_probe_scores_informative_features_high_and_collapsed_ones_at_chance(probe_script) -> None:
    train, test = brightness_data(probe_script, 200, 0), brightness_data(probe_script, 100, 1)
    informative = probe_script.probe(MeanPixel(), train, test)
    collapsed = probe_script.probe(Constant(), train, test)
    assert informative["probe_balanced_accuracy"] == pytest.approx(1.0) and informative["feature_std"] > 0.1
    assert collapsed["probe_balanced_accuracy"] == pytest.approx(0.5) and collapsed["feature_std"] == 0.0
