"""`make_site_data` / `describe_partition`: per-site slices, label pipeline, local mode, loaders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from medflare.data import DataConfig, ImageDataset, describe_partition, load_source, make_site_data
from medflare.errors import ConfigError, DataError

SOURCE = "synthetic:n=600,n_val=120,n_test=150,size=20"


def _all_sites(cfg: DataConfig) -> list:
    return [make_site_data(cfg, i) for i in range(cfg.num_sites)]


def _image_keys(dataset: ImageDataset) -> set[bytes]:
    """Byte strings of the raw images of a dataset (synthetic images are unique, so they identify samples)."""
    image_set = dataset.images
    return {image_set.images[i].tobytes() for i in range(len(image_set))}


@pytest.mark.parametrize("eval_split", ["pooled", "like_train"])
@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "quantity:2", "longtail-missing:1.0"])
def test_sites_are_disjoint_and_eval_splits_tile_the_pooled_sets(scheme: str, eval_split: str) -> None:
    """Training slices never overlap; per-site val/test together are exactly the pooled val/test sets."""
    # Prepare
    cfg = DataConfig(source=SOURCE, partition=scheme, num_sites=3, eval_split=eval_split)
    pooled = load_source(SOURCE, seed=cfg.seed)

    # Execute
    sites = _all_sites(cfg)

    # Assert
    train_keys = [_image_keys(site.train) for site in sites]
    assert sum(len(keys) for keys in train_keys) == len(set().union(*train_keys))
    for split in ("val", "test"):
        per_site = [getattr(site, split).images for site in sites]
        assert sum(len(s) for s in per_site) == len(getattr(pooled, split))
        summed = sum(np.bincount(s.labels, minlength=5) for s in per_site)
        assert summed.tolist() == pooled.info["counts"][split]
        assert set().union(*(_image_keys(getattr(site, split)) for site in sites)) == \
            {image.tobytes() for image in getattr(pooled, split).images}


def test_local_site_takes_the_whole_source() -> None:
    """local=True: no partition, the site holds every train/val/test sample."""
    # Prepare
    cfg = DataConfig(source=SOURCE, partition="dirichlet:0.1", num_sites=5, local=True)
    pooled = load_source(SOURCE)

    # Execute
    site = make_site_data(cfg, 0, "hospital-a")

    # Assert
    assert (len(site.train), len(site.val), len(site.test)) == (len(pooled.train), len(pooled.val), len(pooled.test))
    assert site.site_name == "hospital-a" and site.identified is None
    assert site.class_counts.tolist() == pooled.info["counts"]["train"]
    with pytest.raises(ConfigError, match="simulation only"):
        describe_partition(cfg)


def test_labelset_site_masks_unidentified_classes() -> None:
    """Under labelset:K a site's non-identified classes are -1 in training, counted nowhere; test stays clean."""
    # Prepare
    cfg = DataConfig(source=SOURCE, partition="labelset:2", num_sites=3)

    # Execute
    site = make_site_data(cfg, 1)

    # Assert
    labels = site.train.labels
    assert site.identified.sum() == 2
    assert set(np.unique(labels[labels >= 0])) <= set(np.flatnonzero(site.identified))
    assert (labels == -1).sum() > 0
    assert site.class_counts.sum() == (labels >= 0).sum()
    assert (site.class_counts[~site.identified] == 0).all()
    assert (site.test.labels >= 0).all()


def test_label_noise_hits_training_only_at_the_configured_rate() -> None:
    """Training labels are flipped at about μ; val/test labels equal the clean ones."""
    # Prepare
    clean_cfg = DataConfig(source="synthetic:n=4000,n_val=60,n_test=60,size=12", num_sites=2)
    noisy_cfg = DataConfig(source=clean_cfg.source, num_sites=2, label_noise=0.3, noise_kind="pairflip")

    # Execute
    clean, noisy = make_site_data(clean_cfg, 0), make_site_data(noisy_cfg, 0)

    # Assert
    assert np.mean(clean.train.labels != noisy.train.labels) == pytest.approx(0.3, abs=0.03)
    assert np.array_equal(clean.test.labels, noisy.test.labels)
    assert noisy.class_counts.tolist() == np.bincount(noisy.train.labels, minlength=5).tolist()


def _class_shares(labels: np.ndarray) -> np.ndarray:
    return np.bincount(labels, minlength=5) / len(labels)


def test_like_train_eval_split_follows_each_sites_class_mix() -> None:
    """eval_split=like_train: a site's test classes are mixed like its training classes, missing ones absent."""
    # Prepare
    source = "synthetic:n=3000,n_val=300,n_test=1500,size=8"
    cfg = DataConfig(source=source, partition="longtail-missing:0.5:1", num_sites=3, eval_split="like_train")
    pooled = DataConfig(source=source, partition=cfg.partition, num_sites=3)

    # Execute
    sites, pooled_sites = _all_sites(cfg), _all_sites(pooled)

    # Assert
    for site, pooled_site in zip(sites, pooled_sites):
        train, test = _class_shares(site.train.labels), _class_shares(site.test.labels)
        assert np.array_equal(test == 0, train == 0), "a class missing in training must be missing in test"
        assert np.abs(train - test).max() < 0.06
        assert np.abs(train - _class_shares(pooled_site.test.labels)).max() > 0.1  # pooled is not like train
        assert (site.test.labels >= 0).all() and (site.val.labels >= 0).all()


def test_like_train_under_labelset_keeps_evaluation_labels_clean() -> None:
    """Under labelset:K the training classes are IID (only annotation differs): test stays clean and complete."""
    # Prepare
    cfg = DataConfig(source=SOURCE, partition="labelset:2", num_sites=3, eval_split="like_train")

    # Execute
    sites = _all_sites(cfg)

    # Assert
    for site in sites:
        assert (site.train.labels == -1).any() and (site.test.labels >= 0).all()
        assert (np.bincount(site.test.labels, minlength=5) > 0).all()


def test_label_noise_per_site() -> None:
    """A list of rates gives each site its own flip rate; a rate of 0 leaves that site's labels clean."""
    # Prepare
    source = "synthetic:n=4000,n_val=60,n_test=60,size=12"
    clean = _all_sites(DataConfig(source=source, num_sites=2))

    # Execute
    noisy = _all_sites(DataConfig(source=source, num_sites=2, label_noise=[0.0, 0.3]))

    # Assert
    assert np.array_equal(clean[0].train.labels, noisy[0].train.labels)
    assert np.mean(clean[1].train.labels != noisy[1].train.labels) == pytest.approx(0.3, abs=0.03)
    assert np.array_equal(clean[1].test.labels, noisy[1].test.labels)


@pytest.mark.parametrize(("values", "message"), [
    ({"label_noise": [0.1, 0.2, 0.3]}, "3 rates for 2 sites"),
    ({"label_noise": [0.1, 1.2]}, r"data.label_noise must be between 0 and 1, got \[0.1, 1.2\]"),
    ({"eval_split": "iid"}, "eval_split"),
])
def test_bad_per_site_data_options_are_config_errors(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(source=SOURCE, num_sites=2, **values)


def test_site_shift_changes_site_images_consistently() -> None:
    """With site_shift > 0 the site's images differ from the unshifted ones, the same way every call."""
    # Prepare
    plain = DataConfig(source=SOURCE, num_sites=2)
    shifted = DataConfig(source=SOURCE, num_sites=2, site_shift=1.0)

    # Execute
    a, b, again = make_site_data(plain, 1), make_site_data(shifted, 1), make_site_data(shifted, 1)

    # Assert
    assert not np.array_equal(a.train.images.images, b.train.images.images)
    assert np.array_equal(b.test.images.images, again.test.images.images)
    assert np.array_equal(a.train.labels, b.train.labels)


def test_describe_partition_matches_site_data() -> None:
    """The per-site summary agrees with what make_site_data builds."""
    # Prepare
    cfg = DataConfig(source=SOURCE, partition="dirichlet:0.3", num_sites=4, label_noise=0.2)

    # Execute
    summary = describe_partition(cfg)

    # Assert
    assert [row["site"] for row in summary] == ["site-1", "site-2", "site-3", "site-4"]
    for index, row in enumerate(summary):
        site = make_site_data(cfg, index)
        assert row["n_train"] == len(site.train) and row["n_test"] == len(site.test)
        assert row["class_counts"] == site.class_counts.tolist()
    assert sum(row["n_train"] for row in summary) == 600


def test_loader_yields_resized_float_batches_with_int64_labels() -> None:
    """A DataLoader over a site's datasets gives float32 [B, C, S, S] in [-1, 1] and int64 labels."""
    # Prepare
    cfg = DataConfig(source="synthetic:n=200,n_val=40,n_test=40,channels=1", num_sites=2, image_size=32)
    site = make_site_data(cfg, 0)

    # Execute
    images, labels = next(iter(DataLoader(site.train, batch_size=16, shuffle=True)))

    # Assert
    assert images.shape == (16, 1, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert images.min() >= -1.0 and images.max() <= 1.0
    assert (site.channels, site.image_size, site.num_classes) == (1, 32, 5)
    assert site.attributes_test is not None and len(site.attributes_test) == len(site.test)


def test_file_sources_work_per_site(png_manifest: Callable[..., Path]) -> None:
    """A CSV source builds site datasets that decode files lazily at their native size."""
    # Prepare
    manifest = png_manifest([{"path": f"{i}.png", "label": i % 2} for i in range(60)])
    cfg = DataConfig(source=f"csv:{manifest}", num_sites=2, min_size=5, num_classes=2)

    # Execute
    site = make_site_data(cfg, 1)
    image, label = site.train[0]

    # Assert
    assert image.shape == (1, 12, 12) and label in (0, 1)
    with pytest.raises(ConfigError, match="site_shift needs an in-memory source"):
        make_site_data(DataConfig(source=cfg.source, num_sites=2, min_size=5, site_shift=0.5), 0)


def test_empty_training_split_names_the_site(png_manifest: Callable[..., Path]) -> None:
    """A local site whose manifest has no training rows fails with a DataError naming the site."""
    # Prepare
    manifest = png_manifest([{"path": f"{i}.png", "label": i % 2, "split": "test"} for i in range(6)],
                            header=("path", "label", "split"))

    # Execute / Assert
    with pytest.raises(DataError, match="Site 'hospital-b' has no training samples"):
        make_site_data(DataConfig(source=f"csv:{manifest}", local=True), 0, "hospital-b")


@pytest.mark.parametrize("kwargs, message", [
    ({"num_sites": 0}, "data.num_sites must be between 1 and 1000, got 0"),
    ({"label_noise": 1.5}, "data.label_noise must be between 0 and 1, got 1.5"),
    ({"noise_kind": "asym"}, "data.noise_kind must be one of .*, got 'asym'"),
    ({"partition": "random"}, "unknown scheme 'random'"),
    ({"augment": "heavy"}, "data.augment must be one of .*, got 'heavy'"),
])
def test_bad_data_config_fails_early(kwargs: dict, message: str) -> None:
    """Invalid settings raise ConfigError when the config is built, before any data is touched."""
    with pytest.raises(ConfigError, match=message):
        DataConfig(**kwargs)


def test_site_index_out_of_range_is_a_config_error() -> None:
    """Index 3 of 3 sites does not exist."""
    with pytest.raises(ConfigError, match="site-4.*outside \\[0, 3\\)"):
        make_site_data(DataConfig(source=SOURCE, num_sites=3), 3)


def test_label_fraction_keeps_that_share_of_each_class_and_the_images() -> None:
    """SSL-FL's label-efficiency split: per site and class round(f x n_k) labels (at least one) stay; the other
    training images stay too, unlabelled (-1); a smaller fraction keeps a subset of a larger one's labels."""
    # Prepare
    full = _all_sites(DataConfig(source=SOURCE, num_sites=2, partition="dirichlet:1.0"))

    # Execute
    thirty = _all_sites(DataConfig(source=SOURCE, num_sites=2, partition="dirichlet:1.0", label_fraction=0.3))
    ten = _all_sites(DataConfig(source=SOURCE, num_sites=2, partition="dirichlet:1.0", label_fraction=0.1))

    # Assert
    for whole, some, fewer in zip(full, thirty, ten):
        assert len(some.train) == len(whole.train) and np.array_equal(some.test.labels, whole.test.labels)
        expected = [max(1, round(0.3 * n)) if n else 0 for n in whole.class_counts]
        assert some.class_counts.tolist() == expected
        kept = some.train.labels >= 0
        assert np.array_equal(some.train.labels[kept], whole.train.labels[kept])  # kept labels are the true ones
        assert np.all(kept[fewer.train.labels >= 0])  # nested: the 10 % labels are among the 30 % labels


def test_label_fraction_per_site() -> None:
    sites = _all_sites(DataConfig(source=SOURCE, num_sites=2, label_fraction=[1.0, 0.5]))
    assert np.all(sites[0].train.labels >= 0)
    assert (sites[1].train.labels < 0).mean() == pytest.approx(0.5, abs=0.02)
    assert describe_partition(DataConfig(source=SOURCE, num_sites=2, label_fraction=[1.0, 0.5]))[1]["n_unlabeled"] > 0


@pytest.mark.parametrize(("values", "message"), [
    ({"label_fraction": 0.0}, r"data.label_fraction must be between 0 \(excluded\) and 1, got 0.0"),
    ({"label_fraction": [0.1]}, "1 shares for 2 sites"),
])
def test_bad_label_fraction_is_a_config_error(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(source=SOURCE, num_sites=2, **values)
