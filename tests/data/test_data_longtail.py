"""``data.imbalance``: a long-tailed training split cut from any source, the most abundant class as its head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from medflare.data import DataConfig, describe_partition, make_site_data
from medflare.data.longtail import long_tail_indices
from medflare.errors import ConfigError, DataError


def write_npz(path: Path, train_counts: list[int], seed: int = 0) -> Path:
    """A MedMNIST-layout file whose training split has ``train_counts`` images per class."""
    rng = np.random.default_rng(seed)
    labels = {"train": np.repeat(np.arange(len(train_counts)), train_counts),
              "val": np.repeat(np.arange(len(train_counts)), 5), "test": np.repeat(np.arange(len(train_counts)), 6)}
    arrays = {f"{split}_labels": rng.permutation(y)[:, None] for split, y in labels.items()}
    arrays |= {f"{split}_images": rng.integers(0, 256, (len(y), 8, 8), dtype=np.uint8) for split, y in labels.items()}
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("imbalance", [2.0, 10.0, 25.0])
def test_cut_follows_the_profile_with_the_most_abundant_class_as_head(imbalance: float) -> None:
    labels = np.repeat([0, 1, 2, 3], [80, 300, 120, 200])  # abundance order: 1, 3, 2, 0

    kept = long_tail_indices(labels, 4, imbalance, seed=0)

    counts = np.bincount(labels[kept], minlength=4)
    order = [1, 3, 2, 0]
    assert list(counts[order]) == sorted(counts, reverse=True)
    assert counts[1] / counts[0] == pytest.approx(imbalance, rel=0.05)
    assert (counts <= np.bincount(labels)).all() and len(set(kept)) == len(kept)
    np.testing.assert_array_equal(kept, long_tail_indices(labels, 4, imbalance, seed=0))
    assert not np.array_equal(kept, long_tail_indices(labels, 4, imbalance, seed=1))


def test_imbalance_works_on_a_real_data_layout_and_leaves_val_and_test_alone(tmp_path: Path) -> None:
    """An npz source (not synthetic) gets a long-tailed training split; val/test keep every image."""
    path = write_npz(tmp_path / "balanced.npz", [100, 100, 100])
    full = DataConfig(source=f"medmnist:{path}", num_sites=2, min_size=1)
    cut = DataConfig(source=f"medmnist:{path}", num_sites=2, min_size=1, imbalance=10.0)

    facts = describe_partition(cut)
    counts = np.sum([site["class_counts"] for site in facts], axis=0)

    assert counts.max() / counts.min() == pytest.approx(10.0, rel=0.05)
    assert sum(s["n_test"] for s in facts) == sum(s["n_test"] for s in describe_partition(full)) == 18
    site = make_site_data(cut, 0)
    assert len(site.train) == facts[0]["n_train"] and site.class_counts.tolist() == facts[0]["class_counts"]


def test_too_steep_an_imbalance_for_the_data_is_refused(tmp_path: Path) -> None:
    path = write_npz(tmp_path / "small.npz", [12, 12])
    with pytest.raises(DataError, match="data.imbalance=50 would leave class .* without training images"):
        describe_partition(DataConfig(source=f"medmnist:{path}", imbalance=50.0, min_size=1))
    with pytest.raises(ConfigError, match="data.imbalance must be between 1 and 1000000, got 0.5"):
        DataConfig(imbalance=0.5)
