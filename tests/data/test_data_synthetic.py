"""Synthetic lesion generator: determinism, long tail, attribute, site shift, speed and learnability."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from medflare.data import SyntheticConfig, apply_site_shift, load_source
from medflare.data.synthetic import make_synthetic
from medflare.errors import ConfigError, DataError


def test_same_seed_is_byte_identical_and_other_seed_differs() -> None:
    """Two generations with one seed are byte-identical in every split; another seed differs."""
    # Prepare
    config = SyntheticConfig(n=400)

    # Execute
    first, again, other = make_synthetic(config, 11), make_synthetic(config, 11), make_synthetic(config, 12)

    # Assert
    for split in ("train", "val", "test"):
        a, b, c = (getattr(s, split) for s in (first, again, other))
        assert a.images.tobytes() == b.images.tobytes()
        assert np.array_equal(a.labels, b.labels) and np.array_equal(a.attributes, b.attributes)
        assert a.images.tobytes() != c.images.tobytes()


@pytest.mark.parametrize("n, classes, imbalance", [(2400, 5, 20.0), (3000, 10, 100.0), (1000, 4, 1.0)])
def test_train_counts_follow_exponential_long_tail(n: int, classes: int, imbalance: float) -> None:
    """Train counts sum to n, decrease from class 0, and max/min ≈ the imbalance ratio (within 10%)."""
    # Execute
    splits = make_synthetic(SyntheticConfig(n=n, classes=classes, imbalance=imbalance, n_val=50, n_test=50), 0)

    # Assert
    counts = np.bincount(splits.train.labels, minlength=classes)
    assert counts.sum() == n
    assert np.all(np.diff(counts) <= 0)
    assert counts.max() / counts.min() == pytest.approx(imbalance, rel=0.1)
    expected = n * imbalance ** (-np.arange(classes) / (classes - 1))
    expected *= n / expected.sum()
    np.testing.assert_allclose(counts, expected, atol=1.5)


def test_eval_splits_are_balanced_and_sized_from_n() -> None:
    """Val and test are class-balanced with max(300, n // 4) images by default."""
    # Execute
    splits = make_synthetic(SyntheticConfig(n=2000, imbalance=10), 0)

    # Assert
    for image_set in (splits.val, splits.test):
        counts = np.bincount(image_set.labels)
        assert len(image_set) == 500 and counts.max() - counts.min() <= 1


def test_attribute_prevalence_and_dark_backgrounds() -> None:
    """The attribute follows dark_fraction and attribute-1 images are darker."""
    # Execute
    splits = make_synthetic(SyntheticConfig(n=2000, dark_fraction=0.3, n_val=0, n_test=0), 4)

    # Assert
    attributes, images = splits.train.attributes, splits.train.images
    assert attributes.mean() == pytest.approx(0.3, abs=0.03)
    corner_brightness = images[:, :3, :3].reshape(len(images), -1).mean(axis=1)
    assert corner_brightness[attributes == 1].mean() < corner_brightness[attributes == 0].mean() - 40


@pytest.mark.parametrize("size, channels", [(28, 3), (28, 1), (64, 3), (17, 1)])
def test_any_size_and_channel_count(size: int, channels: int) -> None:
    """Images are uint8 [N, size, size, channels] and use a real intensity range."""
    # Execute
    splits = make_synthetic(SyntheticConfig(n=60, size=size, channels=channels, n_val=10, n_test=10), 0)

    # Assert
    images = splits.train.images
    assert images.shape == (60, size, size, channels) and images.dtype == np.uint8
    assert images.std() > 10


def test_generating_3000_images_is_fast() -> None:
    """3000 RGB 28x28 images take well under 2 s of CPU time (CPU, not wall, time: other jobs may share the cores)."""
    # Prepare
    config = SyntheticConfig(n=3000, n_val=0, n_test=0)
    make_synthetic(SyntheticConfig(n=20, n_val=0, n_test=0), 0)  # warm-up: first-call numpy overheads

    # Execute
    start = time.process_time()
    make_synthetic(config, 0)
    elapsed = time.process_time() - start

    # Assert
    assert elapsed < 2.0, f"generation took {elapsed:.2f} s"


def test_site_shift_is_deterministic_per_site_and_changes_statistics() -> None:
    """A site's shift is reproducible, differs between sites, changes pixel statistics; strength 0 is a no-op."""
    # Prepare
    images = make_synthetic(SyntheticConfig(n=200, n_val=0, n_test=0), 0).train.images

    # Execute
    site0, site0_again, site1 = (apply_site_shift(images, site, 1.0, seed=0) for site in (0, 0, 1))
    unchanged = apply_site_shift(images, 0, 0.0, seed=0)

    # Assert
    assert site0.dtype == np.uint8 and site0.shape == images.shape
    assert np.array_equal(site0, site0_again)
    channel_means = [a.reshape(-1, 3).mean(axis=0) for a in (images, site0, site1)]
    assert np.abs(channel_means[1] - channel_means[0]).max() > 5
    assert np.abs(channel_means[2] - channel_means[1]).max() > 5
    assert np.array_equal(unchanged, images) and unchanged is not images


@pytest.mark.parametrize("spec, error, message", [
    ("synthetic:colour=red", ConfigError, "Bad synthetic option 'colour=red'"),
    ("synthetic:n=lots", ConfigError, "not a valid int"),
    ("synthetic:imbalance=0.5", ConfigError, "imbalance"),
])
def test_bad_synthetic_options_raise_config_error(spec: str, error: type, message: str) -> None:
    """Unknown keys, bad values and out-of-range settings are rejected with the reason."""
    with pytest.raises(error, match=message):
        load_source(spec)


def test_synthetic_spec_and_declared_class_count() -> None:
    """Spec keys reach the generator; a declared num_classes must equal the generated class count."""
    # Execute
    explicit = load_source("synthetic:n=90,classes=3,size=20,channels=1", seed=1)
    declared = load_source("synthetic:n=90,classes=4", num_classes=4)

    # Assert
    assert explicit.train.images.shape == (90, 20, 20, 1) and explicit.info["num_classes"] == 3
    assert declared.info["num_classes"] == 4 and declared.train.num_classes == 4
    with pytest.raises(DataError, match="classes=3 but num_classes=4 is declared; add classes=4"):
        load_source("synthetic:classes=3", num_classes=4)
    with pytest.raises(DataError, match="generates classes=5 but num_classes=2"):
        load_source("synthetic", num_classes=2)


def _tiny_cnn(channels: int, num_classes: int) -> nn.Module:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(*block(channels, 16), nn.MaxPool2d(2), *block(16, 32), nn.MaxPool2d(2), *block(32, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def _as_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Runs a test on one intra-op thread: on a busy 2-core machine two threads oversubscribe and crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("seed", [0, 1])
def test_default_synthetic_task_is_learnable_but_not_trivial(seed: int) -> None:
    """A tiny CNN (4 epochs, batch 64, Adam) beats 2x chance on the default set but stays below 98%.

    Checked over seeds 0-9 when the generator was tuned: 0.66-0.77 test accuracy (chance 0.2).
    """
    # Prepare
    splits = load_source("synthetic", seed=seed)
    torch.manual_seed(seed)
    model = _tiny_cnn(splits.train.channels, splits.train.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    images, labels = _as_tensor(splits.train.images), torch.from_numpy(np.array(splits.train.labels))
    order = torch.Generator().manual_seed(seed)

    # Execute
    for _ in range(4):
        model.train()
        for batch in torch.randperm(len(labels), generator=order).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model(_as_tensor(splits.test.images)).argmax(dim=1).numpy()
    accuracy = float(np.mean(predicted == splits.test.labels))

    # Assert
    chance = 1.0 / splits.train.num_classes
    assert 2 * chance < accuracy < 0.98, f"test accuracy {accuracy:.3f}"
