"""Partitioners: structure, determinism, skew, attribute mixing, label-set masks, missing classes."""

from __future__ import annotations

import numpy as np
import pytest

from medflare.data import apply_label_mask, partition, partition_like
from medflare.data.partition import SCHEME_FORMS
from medflare.errors import ConfigError, DataError

NUM_CLASSES = 5


def _labels(n: int = 3000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, NUM_CLASSES, n)


def _attributes(n: int = 3000, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < 0.5).astype(np.int64)


def _class_shares(labels: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return np.bincount(labels[indices], minlength=NUM_CLASSES) / max(len(indices), 1)


# (scheme, sites, covers every sample)
SCHEMES = [
    ("iid", 4, True),
    ("dirichlet:0.5", 4, True),
    ("dirichlet:100", 5, True),
    ("quantity:1.0", 4, True),
    ("attribute:0.1/0.3/0.7/0.9", 4, False),
    ("labelset:2", 4, True),
    ("longtail-missing:0.5", 4, True),
    ("longtail-missing:1.0:2", 3, True),
    ("class-dirichlet:50/30/10/5/0.5:0.3", 4, True),
    ("class-dirichlet:1/1/1/1/1", 3, True),
]


@pytest.mark.parametrize("scheme, num_sites, complete", SCHEMES)
def test_partition_is_disjoint_sorted_and_large_enough(scheme: str, num_sites: int, complete: bool) -> None:
    """Every scheme returns sorted int64, disjoint sites of at least min_size (covering all where promised)."""
    # Prepare
    labels = _labels()

    # Execute
    result = partition(labels, num_sites, scheme, seed=3, min_size=20, attributes=_attributes())

    # Assert
    assert len(result.indices) == num_sites
    joined = np.concatenate(result.indices)
    assert len(np.unique(joined)) == len(joined), "sites overlap"
    for site in result.indices:
        assert site.dtype == np.int64 and np.all(np.diff(site) > 0) and len(site) >= 20
    if complete:
        assert np.array_equal(np.sort(joined), np.arange(len(labels)))


@pytest.mark.parametrize("scheme, num_sites, _complete", SCHEMES)
def test_partition_is_seed_deterministic(scheme: str, num_sites: int, _complete: bool) -> None:
    """Same seed gives identical sites; another seed gives different ones."""
    # Prepare
    labels, attributes = _labels(), _attributes()

    # Execute
    first, again, other = (partition(labels, num_sites, scheme, seed=seed, attributes=attributes)
                           for seed in (7, 7, 8))

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first.indices, again.indices))
    assert not all(np.array_equal(a, b) for a, b in zip(first.indices, other.indices))


def _fedml_reference(labels: np.ndarray, num_sites: int, alpha: float, seed: int, min_size: int) -> list:
    """Spec §1.2 written the FedML way, with the same RNG call order as medflare's implementation."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    smallest = -1
    while smallest < min_size:
        batches = [[] for _ in range(num_sites)]
        for k in np.unique(labels):
            idx_k = rng.permutation(np.where(labels == k)[0])
            p = rng.dirichlet(np.repeat(alpha, num_sites))
            p = np.array([pj * (len(bj) < n / num_sites) for pj, bj in zip(p, batches)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
            batches = [bj + part.tolist() for bj, part in zip(batches, np.split(idx_k, cuts))]
        smallest = min(len(bj) for bj in batches)
    return [np.sort(np.array(bj)) for bj in batches]


@pytest.mark.parametrize("alpha, num_sites, seed", [(0.5, 4, 0), (0.1, 3, 5), (1.0, 8, 2)])
def test_dirichlet_matches_fedml_reference(alpha: float, num_sites: int, seed: int) -> None:
    """`dirichlet:ALPHA` is exactly the FedML partitioner of spec §1.2 (cap at N/C, redraw until min size)."""
    # Prepare
    labels = _labels(1500, seed=4)

    # Execute
    result = partition(labels, num_sites, f"dirichlet:{alpha}", seed=seed, min_size=10)

    # Assert
    expected = _fedml_reference(labels, num_sites, alpha, seed, 10)
    assert all(np.array_equal(a, b) for a, b in zip(result.indices, expected))


def test_dirichlet_huge_alpha_is_close_to_iid() -> None:
    """With α = 1e4 every site's class mix matches the global mix within 3 points."""
    # Prepare
    labels = _labels(5000)

    # Execute
    result = partition(labels, 4, "dirichlet:10000", seed=0)

    # Assert
    overall = _class_shares(labels, np.arange(len(labels)))
    for site in result.indices:
        assert np.abs(_class_shares(labels, site) - overall).max() < 0.03


def test_dirichlet_tiny_alpha_is_skewed() -> None:
    """With α = 0.05 a site's largest class dominates it."""
    # Prepare
    labels = _labels(5000)

    # Execute
    result = partition(labels, 4, "dirichlet:0.05", seed=0, min_size=10)

    # Assert
    dominant = [_class_shares(labels, site).max() for site in result.indices]
    assert np.mean(dominant) > 0.6


def test_partition_too_small_sites_raise_with_site_and_fix() -> None:
    """If redraws cannot reach min_size, DataError names the site, its size and the fixes."""
    # Prepare
    labels = _labels(200)

    # Execute / Assert
    with pytest.raises(DataError, match=r"site-\d+ only \d+ samples.*lower the number of sites, raise its ALPHA"):
        partition(labels, 30, "dirichlet:0.01", seed=0, min_size=10)
    with pytest.raises(DataError) as iid:
        partition(labels, 8, "iid", seed=0, min_size=50)
    # issue 61 (minors): iid has no ALPHA, and sites are named as the job names them (site-1, not site 0)
    assert "data.min_size=50" in str(iid.value) and "ALPHA" not in str(iid.value)
    assert "site-0" not in str(iid.value) and "site 0" not in str(iid.value)


@pytest.mark.parametrize("alpha, spread", [(0.5, "skewed"), (10000.0, "even")])
def test_quantity_skew_sizes_and_iid_labels(alpha: float, spread: str) -> None:
    """`quantity:ALPHA` varies site sizes (small α) but keeps each site's class mix near the global one."""
    # Prepare
    labels = _labels(6000)

    # Execute
    result = partition(labels, 5, f"quantity:{alpha}", seed=1)

    # Assert
    sizes = np.array(result.sizes())
    cv = sizes.std() / sizes.mean()
    assert cv > 0.3 if spread == "skewed" else cv < 0.05
    overall = _class_shares(labels, np.arange(len(labels)))
    largest = result.indices[int(sizes.argmax())]
    assert np.abs(_class_shares(labels, largest) - overall).max() < 0.05


@pytest.mark.parametrize("fractions", [(0.1, 0.3, 0.7, 0.9), (0.0, 1.0), (0.5, 0.5, 0.5), (0.2, 0.95)])
def test_attribute_partition_hits_requested_mix(fractions: tuple[float, ...]) -> None:
    """Site i holds a share F_i of attribute-1 samples (±1 point) and all sites have the same size."""
    # Prepare
    labels, attributes = _labels(), _attributes()
    scheme = "attribute:" + "/".join(str(f) for f in fractions)

    # Execute
    result = partition(labels, len(fractions), scheme, seed=0, attributes=attributes)

    # Assert
    assert len(set(result.sizes())) == 1
    for share, site in zip(fractions, result.indices):
        assert attributes[site].mean() == pytest.approx(share, abs=0.01)


def test_attribute_partition_needs_attributes_and_one_fraction_per_site() -> None:
    """Missing attributes → DataError; fraction count ≠ site count → ConfigError."""
    with pytest.raises(DataError, match="attribute"):
        partition(_labels(), 2, "attribute:0.2/0.8", seed=0)
    with pytest.raises(ConfigError, match="3 fractions for 2 sites"):
        partition(_labels(), 2, "attribute:0.2/0.5/0.8", seed=0, attributes=_attributes())


@pytest.mark.parametrize("num_sites, per_site", [(5, 3), (4, 2), (2, 3), (3, 5)])
def test_labelset_masks_have_k_classes_and_cover_all(num_sites: int, per_site: int) -> None:
    """Each site identifies exactly K classes; together they identify every class."""
    # Prepare
    labels = _labels()

    # Execute
    result = partition(labels, num_sites, f"labelset:{per_site}", seed=0, num_classes=NUM_CLASSES)

    # Assert
    masks = np.stack(result.identified)
    assert masks.shape == (num_sites, NUM_CLASSES) and masks.dtype == bool
    assert (masks.sum(axis=1) == per_site).all()
    assert masks.any(axis=0).all()


def test_labelset_infeasible_k_is_a_config_error() -> None:
    """2 sites × 2 classes cannot cover 5 classes."""
    with pytest.raises(ConfigError, match="cannot cover all 5 classes"):
        partition(_labels(), 2, "labelset:2", seed=0)


def test_apply_label_mask_sets_unidentified_classes_to_minus_one() -> None:
    """Labels of classes outside the mask become -1; identified labels and existing -1 are kept."""
    # Prepare
    labels = np.array([0, 1, 2, 3, 4, -1, 2])
    identified = np.array([True, False, True, False, False])

    # Execute
    masked = apply_label_mask(labels, identified)

    # Assert
    assert masked.tolist() == [0, -1, 2, -1, -1, -1, 2]
    assert labels.tolist() == [0, 1, 2, 3, 4, -1, 2], "input must not be modified"


@pytest.mark.parametrize("scheme, missing", [("longtail-missing:0.5", 1), ("longtail-missing:1.0:2", 2)])
def test_longtail_missing_drops_classes_but_keeps_each_somewhere(scheme: str, missing: int) -> None:
    """Each site lacks at least M classes entirely, and every class is held by some site."""
    # Prepare
    labels = _labels()

    # Execute
    result = partition(labels, 4, scheme, seed=2)

    # Assert
    held = np.stack([np.bincount(labels[site], minlength=NUM_CLASSES) > 0 for site in result.indices])
    assert ((~held).sum(axis=1) >= missing).all()
    assert held.any(axis=0).all()


@pytest.mark.parametrize("scheme, message", [
    ("gaussian:1", "unknown scheme 'gaussian'"),
    ("dirichlet", "takes 1"),
    ("dirichlet:-1", "ALPHA must be > 0"),
    ("dirichlet:abc", "not a valid float"),
    ("attribute:0.5/1.5", r"in \[0, 1\]"),
    ("labelset:0", "K must be >= 1"),
    ("longtail-missing:0.5:9", "lower M"),
    ("class-dirichlet:1/0/1", "A_k must be > 0"),
    ("class-dirichlet:1/1:1.0", "P must be < 1"),
])
def test_bad_schemes_raise_config_error_listing_forms(scheme: str, message: str) -> None:
    """Malformed or unknown schemes fail with ConfigError that says what is wrong (and lists forms)."""
    with pytest.raises(ConfigError, match=message) as caught:
        partition(_labels(), 2, scheme, seed=0)
    if "lower M" not in message:
        assert all(form in str(caught.value) for form in SCHEME_FORMS)


def _held(labels: np.ndarray, sites: list[np.ndarray]) -> np.ndarray:
    """bool [site, class]: which classes each site holds at least one sample of."""
    return np.stack([np.bincount(labels[site], minlength=NUM_CLASSES) > 0 for site in sites])


def test_class_dirichlet_skews_each_class_by_its_own_alpha() -> None:
    """α_k = 1000 spreads class k evenly; α_k = 0.05 piles it onto few sites (FCA's per-class α)."""
    # Prepare
    labels = _labels(5000)

    # Execute
    results = [partition(labels, 4, "class-dirichlet:1000/1000/1000/1000/0.05", seed=seed, min_size=10)
               for seed in range(5)]

    # Assert: a class's largest site share
    def largest_share(result, k: int) -> float:
        counts = np.array([np.sum(labels[site] == k) for site in result.indices])
        return counts.max() / counts.sum()

    assert all(largest_share(r, k) < 0.3 for r in results for k in range(4))
    assert np.mean([largest_share(r, 4) for r in results]) > 0.6


@pytest.mark.parametrize("drop", [0.0, 0.3, 0.5])
def test_class_dirichlet_drops_each_class_per_site_with_probability_p(drop: float) -> None:
    """About a share P of (site, class) pairs hold nothing; every class stays somewhere, every site non-empty."""
    # Prepare
    labels = _labels(20000)

    # Execute
    results = [partition(labels, 20, f"class-dirichlet:100/100/100/100/100:{drop}", seed=seed, min_size=1)
               for seed in range(5)]

    # Assert
    helds = [_held(labels, result.indices) for result in results]
    assert np.mean([np.mean(~held) for held in helds]) == pytest.approx(drop, abs=0.08)
    assert all(held.any(axis=0).all() and held.any(axis=1).all() for held in helds)


def test_class_dirichlet_needs_one_alpha_per_class() -> None:
    with pytest.raises(ConfigError, match="3 alphas for 5 classes"):
        partition(_labels(), 2, "class-dirichlet:1/2/3", seed=0)


def _train_mix(labels: np.ndarray, sites: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.bincount(labels[site], minlength=NUM_CLASSES) for site in sites])


def test_partition_like_follows_each_sites_training_mix() -> None:
    """Per-site test class proportions track the site's training proportions (Dirichlet-skewed training)."""
    # Prepare
    train_labels, test_labels = _labels(3000, seed=0), _labels(1500, seed=9)
    train = partition(train_labels, 4, "dirichlet:0.3", seed=0)
    mix = _train_mix(train_labels, train.indices)

    # Execute
    test = partition_like(test_labels, mix, seed=0)

    # Assert
    train_shares = mix / mix.sum(axis=1, keepdims=True)
    test_counts = _train_mix(test_labels, test.indices)
    test_shares = test_counts / test_counts.sum(axis=1, keepdims=True)
    assert np.corrcoef(train_shares.ravel(), test_shares.ravel())[0, 1] > 0.97
    assert np.abs(train_shares - test_shares).max() < 0.06


def test_partition_like_keeps_missing_classes_missing() -> None:
    """A class a site never trains on is absent from its test slice; a class no site trains on is spread."""
    # Prepare
    test_labels = _labels(1000, seed=3)
    mix = np.array([[30, 0, 10, 5, 0], [0, 20, 10, 0, 0], [10, 10, 0, 5, 0]])  # class 4 trained nowhere

    # Execute
    test = partition_like(test_labels, mix, seed=0)

    # Assert
    held = _held(test_labels, test.indices)
    assert not (held[:, :4] & (mix[:, :4] == 0)).any()
    assert held[:, 4].all()
    class_four = [np.sum(test_labels[site] == 4) for site in test.indices]
    assert max(class_four) - min(class_four) <= 1


def test_partition_like_is_disjoint_complete_and_seed_stable() -> None:
    # Prepare
    test_labels = _labels(900, seed=5)
    mix = np.array([[5, 1, 0, 9, 2], [1, 1, 1, 1, 1], [0, 7, 3, 0, 8]])

    # Execute
    first, again, other = (partition_like(test_labels, mix, seed=seed) for seed in (4, 4, 5))

    # Assert
    joined = np.concatenate(first.indices)
    assert np.array_equal(np.sort(joined), np.arange(len(test_labels)))
    assert all(np.array_equal(a, b) for a, b in zip(first.indices, again.indices))
    assert not all(np.array_equal(a, b) for a, b in zip(first.indices, other.indices))


def test_partition_like_rejects_labels_outside_the_training_classes() -> None:
    with pytest.raises(DataError, match="partition_like needs labels"):
        partition_like(np.array([0, 1, 5]), np.ones((2, 5)), seed=0)
