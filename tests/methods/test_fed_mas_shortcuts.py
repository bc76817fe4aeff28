"""Fed-MAS's cost shortcuts (issue 15), each off by default: the prior feature cache, the prior at reduced
precision, and the stratified w pass. Each must give what the paper's computation gives, within a stated bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medflare.errors import ConfigError
from medflare.methods.fed_mas import FedMasConfig
from medflare.methods.fed_mas.prior import PriorFeatureCache, check_finite_views
from medflare.methods.fed_mas.rescue import (
    ClassMeanAccumulator,
    distillation_distance,
    rescue_factor,
    stratified_subsample,
)
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

TASK = TaskSpec(num_classes=3, in_channels=3, image_size=28)
# A cached feature against a fresh forward of another batch: the kernels depend on batch size and thread count
# (measured up to 2.3e-5 on features up to 6.0 in size); another image's feature differs by about 6.
CACHE_TOLERANCE = 1e-4
RF_TOLERANCE = 1e-3  # RF with the prior in bf16 against fp32 (RF lies in (0, 1]; measured 3.5e-4)
W_RELATIVE_TOLERANCE = 0.05  # each class's w with the prior in bf16 against fp32 (measured 0.022)


def fedmas_site(augment: str = "none", **method_args) -> SiteRuntime:
    data = {"source": "synthetic:n=150,classes=3", "partition": "iid", "num_sites": 1, "augment": augment}
    settings = SiteSettings(get_method("fedmas"), TASK, data, method_args=method_args, train={"batch_size": 16})
    return SiteRuntime(settings, "site-1", 0, log=lambda m: None)


def test_cached_prior_features_equal_a_fresh_forward() -> None:
    trainer = fedmas_site(cache_prior_features=True).trainer
    trainer.global_divergence()  # fills the cache, batch by batch in shuffled order
    assert trainer.prior_cache.misses == len(trainer.data.train) - len(trainer.data.train) % 16  # drop_last
    images = torch.stack([trainer.data.train[i][0] for i in (5, 0, 77, 5)])  # another batch, one image twice
    before = trainer.prior_cache.hits
    cached = trainer.prior_features(images)
    assert trainer.prior_cache.hits - before >= 3  # nothing recomputed that was seen (index 5: hit or one miss)
    torch.testing.assert_close(cached, trainer.run_prior(images), atol=CACHE_TOLERANCE, rtol=0)


def test_the_cache_never_mixes_up_two_images() -> None:
    calls = []
    cache = PriorFeatureCache(lambda x: calls.append(len(x)) or x.flatten(1)[:, :2] * 10)
    a, b = torch.zeros(1, 1, 2, 2), torch.ones(1, 1, 2, 2)
    torch.testing.assert_close(cache(torch.cat([a, b, a])), torch.tensor([[0.0, 0.0], [10.0, 10.0], [0.0, 0.0]]))
    torch.testing.assert_close(cache(torch.cat([b, a])), torch.tensor([[10.0, 10.0], [0.0, 0.0]]))
    assert calls == [2]  # two distinct images computed once; the rest were hits


def test_the_cache_is_refused_for_random_augmentation_and_leaves_the_random_state_alone() -> None:
    with pytest.raises(ConfigError, match="data.augment=none"):
        fedmas_site(augment="basic", cache_prior_features=True)
    site = fedmas_site(augment="weak")  # a flip: two views per image, allowed
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    check_finite_views(site.data.train)
    torch.testing.assert_close(torch.rand(3), expected)


def test_reduced_precision_prior_keeps_w_and_rf_within_tolerance() -> None:
    """bf16 autocast moves single features by up to ~14 % on CPU, so the bound is on what Fed-MAS uses: per-class
    mean distances w of a student close to the prior (distance ~0.2, where errors show) and the RF from them."""
    site = fedmas_site(w_pass_per_class=1000)  # every image, no drop_last: both passes see the same images
    trainer, dataset = site.trainer, site.trainer.data.train
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = torch.as_tensor(np.asarray(dataset.labels))
    full = trainer.run_prior(images)
    trainer.cfg.prior_precision = "reduced"
    reduced = trainer.run_prior(images)
    noise = torch.randn(full.shape, generator=torch.Generator().manual_seed(0))
    student = full + 0.5 * full.norm(dim=1, keepdim=True) / full.shape[1] ** 0.5 * noise

    def per_class(teacher: torch.Tensor) -> np.ndarray:
        accumulator = ClassMeanAccumulator(3)
        accumulator.add(labels, distillation_distance(student, teacher))
        return accumulator.per_class(np.bincount(labels.numpy(), minlength=3))

    w_full, w_reduced = per_class(full), per_class(reduced)
    assert not torch.equal(full, reduced)  # bf16 really ran
    np.testing.assert_allclose(w_reduced, w_full, rtol=W_RELATIVE_TOLERANCE)
    w_hat = np.array([1.0, 2.0, 4.0])  # a site whose classes moved unequally during training
    assert abs(rescue_factor(w_reduced, w_hat) - rescue_factor(w_full, w_hat)) <= RF_TOLERANCE
    trainer.cfg.prior_precision = "fp32"
    w_pass_full = trainer.global_divergence()
    trainer.cfg.prior_precision = "reduced"
    assert not np.array_equal(trainer.global_divergence(), w_pass_full)  # the option reaches the w pass


def test_stratified_subsample_caps_each_class_and_is_fixed_per_seed() -> None:
    labels = np.array([0] * 50 + [1] * 7 + [-1] * 5 + [2] * 30)
    rows = stratified_subsample(labels, 10, seed=(4, 2))
    assert np.bincount(labels[rows], minlength=3).tolist() == [10, 7, 10]  # a small class keeps every image
    assert (labels[rows] >= 0).all() and len(set(rows)) == len(rows)
    np.testing.assert_array_equal(rows, stratified_subsample(labels, 10, seed=(4, 2)))
    assert not np.array_equal(rows, stratified_subsample(labels, 10, seed=(4, 3)))


def test_the_w_pass_divides_by_the_drawn_counts() -> None:
    site = fedmas_site(w_pass_per_class=5)
    loader, counts = site.trainer.w_pass_batches(round_index=0)
    assert counts.tolist() == [5, 5, 5] and sum(len(labels) for _, labels in loader) == 15
    w = site.trainer.global_divergence()
    assert w.shape == (3,) and (w > 0).all() and (w <= 4).all()  # per-class means of distances in [0, 4]


def test_shortcut_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="prior_precision"):
        FedMasConfig(prior_precision="int8")
    with pytest.raises(ConfigError, match="w_pass_per_class"):
        FedMasConfig(w_pass_per_class=-1)
    assert (FedMasConfig().cache_prior_features, FedMasConfig().prior_precision, FedMasConfig().w_pass_per_class) == (
        False, "fp32", 0)  # the paper's computation unless a site asks
