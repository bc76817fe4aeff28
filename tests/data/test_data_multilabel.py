"""Multi-label data end to end (sources, synthetic findings, partitions, masks) and identified classes per site."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from medflare.data import (
    DataConfig,
    ImageSet,
    MultiViewDataset,
    apply_label_mask,
    build_transform,
    load_source,
    make_site_data,
    partition,
)
from medflare.data.synthetic import SyntheticConfig, draw_findings, finding_prevalence
from medflare.errors import ConfigError, DataError
from medflare.site_config import read_site_data_config

ML_SOURCE = "synthetic:multilabel=1,classes=6,n=600,size=12"


def test_multi_hot_labels_are_checked_entry_by_entry() -> None:
    """Entries must be 1, 0 or -1 and there must be one column per class; the error names row and class."""
    images = np.zeros((2, 4, 4, 1), dtype=np.uint8)
    ImageSet(labels=[[1, -1, 0], [0, 0, 1]], num_classes=3, channels=1, images=images)
    with pytest.raises(DataError, match="entry 2 at row 1, class 0"):
        ImageSet(labels=[[1, -1, 0], [2, 0, 1]], num_classes=3, channels=1, images=images)
    with pytest.raises(DataError, match="3 entries but num_classes=4"):
        ImageSet(labels=[[1, -1, 0], [0, 0, 1]], num_classes=4, channels=1, images=images)


def test_synthetic_findings_follow_prevalence_and_pairs_co_occur() -> None:
    """Prevalence falls with imbalance; paired findings correlate, unpaired ones do not; same seed, same bytes."""
    config = SyntheticConfig(classes=6, multilabel=1, imbalance=4.0, cooccurrence=0.7)
    labels = draw_findings(20_000, config, np.random.default_rng(0))

    np.testing.assert_allclose(labels.mean(axis=0), finding_prevalence(config), atol=0.015)
    assert finding_prevalence(config)[0] == pytest.approx(4 * finding_prevalence(config)[-1])
    correlation = np.corrcoef(labels.T)
    assert min(correlation[0, 1], correlation[2, 3], correlation[4, 5]) > 0.3
    assert max(abs(correlation[0, 2]), abs(correlation[1, 4]), abs(correlation[3, 5])) < 0.05
    first, second = load_source(ML_SOURCE, seed=3), load_source(ML_SOURCE + ",pixel_noise=0.04", seed=3)
    assert first.train.multi_label and first.train.labels.shape == (600, 6)
    assert np.array_equal(first.train.images, second.train.images)
    assert first.info["multi_label"] and first.info["counts"]["train"] == first.train.labels.sum(axis=0).tolist()


def test_a_finding_is_visible_where_it_is_drawn() -> None:
    """Images with finding k differ from those without it at finding k's place (the task is learnable)."""
    splits = load_source("synthetic:multilabel=1,classes=4,n=400,size=16,overlap=0", seed=0)
    images, labels = splits.train.images.astype(float), splits.train.labels
    for k in range(4):
        gap = np.abs(images[labels[:, k] == 1].mean(axis=0) - images[labels[:, k] == 0].mean(axis=0))
        assert gap.max() > 40, f"finding {k} is invisible"


def test_csv_manifest_with_one_column_per_class(png_manifest: Callable[..., Path]) -> None:
    """label_<name> columns give multi-hot rows; empty or -1 cells are unknown; class names come from columns."""
    rows = [{"path": f"{i}.png", "label_effusion": i % 2, "label_nodule": "" if i % 3 == 0 else 1,
             "label_mass": -1 if i % 5 == 0 else 0, "split": ("train", "val", "test")[i % 3]} for i in range(30)]
    manifest = png_manifest(rows, header=("path", "label_effusion", "label_nodule", "label_mass", "split"))

    splits = load_source(f"csv:{manifest}")

    assert splits.info["class_names"] == ["effusion", "nodule", "mass"]
    assert splits.train.multi_label and splits.train.labels.shape == (10, 3)
    expected = np.array([[i % 2, -1 if i % 3 == 0 else 1, -1 if i % 5 == 0 else 0] for i in range(0, 30, 3)])
    np.testing.assert_array_equal(splits.train.labels, expected)


def test_csv_multi_label_cell_errors_name_line_and_column(png_manifest: Callable[..., Path]) -> None:
    rows = [{"path": "a.png", "label_a": 1, "label_b": 0}, {"path": "b.png", "label_a": "yes", "label_b": 0}]
    manifest = png_manifest(rows, header=("path", "label_a", "label_b"))
    with pytest.raises(DataError, match=r"line 3: label_a 'yes' must be 1, 0, or -1"):
        load_source(f"csv:{manifest}")


def test_medmnist_layout_with_label_rows_loads_as_multi_label(tmp_path: Path) -> None:
    """(N, K) 0/1 labels (ChestMNIST's layout) load as multi-label; mixing layouts across splits is refused."""
    rng = np.random.default_rng(0)
    splits = ("train", "val", "test")
    arrays = {f"{split}_images": rng.integers(0, 256, (8, 28, 28), dtype=np.uint8) for split in splits}
    arrays |= {f"{split}_labels": rng.integers(0, 2, (8, 14), dtype=np.uint8) for split in splits}
    np.savez(tmp_path / "chest.npz", **arrays)
    splits = load_source(f"medmnist:{tmp_path / 'chest.npz'}")
    assert splits.train.multi_label and splits.train.num_classes == 14
    np.testing.assert_array_equal(splits.test.labels, arrays["test_labels"])

    np.savez(tmp_path / "mixed.npz", **{**arrays, "val_labels": arrays["val_labels"][:, :1]})
    with pytest.raises(DataError, match="single- or multi-label alike"):
        load_source(f"medmnist:{tmp_path / 'mixed.npz'}")


def test_multi_label_partitions_keep_prevalence_and_refuse_class_dealing_schemes() -> None:
    labels = load_source(ML_SOURCE, seed=0).train.labels
    parts = partition(labels, 3, "iid", seed=0)
    assert sorted(np.concatenate(parts.indices).tolist()) == list(range(len(labels)))
    for site in parts.indices:
        np.testing.assert_allclose(labels[site].mean(axis=0), labels.mean(axis=0), atol=0.05)
    with pytest.raises(ConfigError, match="needs single-label data"):
        partition(labels, 3, "dirichlet:0.5", seed=0)


def test_label_mask_of_multi_hot_rows_unknowns_only_the_unidentified_columns() -> None:
    labels = np.array([[1, 0, 1], [0, 1, -1]])
    masked = apply_label_mask(labels, np.array([True, False, True]))
    np.testing.assert_array_equal(masked, [[1, -1, 1], [0, -1, -1]])
    np.testing.assert_array_equal(labels, [[1, 0, 1], [0, 1, -1]])  # the input is untouched


def test_multi_label_site_with_labelset_masks_columns_and_keeps_eval_clean() -> None:
    cfg = DataConfig(source=ML_SOURCE, partition="labelset:2", num_sites=3)
    site = make_site_data(cfg, 1)
    assert site.multi_label and site.identified.sum() == 2
    train = site.train.labels
    assert (train[:, ~site.identified] == -1).all() and (train[:, site.identified] >= 0).all()
    assert (site.test.labels >= 0).all()
    np.testing.assert_array_equal(site.class_counts, (train == 1).sum(axis=0))
    images, labels = next(iter(DataLoader(site.train, batch_size=4)))
    assert images.shape == (4, 3, 12, 12) and labels.shape == (4, 6) and labels.dtype == torch.int64


def test_explicit_identified_lists_per_simulated_site() -> None:
    cfg = DataConfig(source="synthetic:n=200,classes=4,size=8", num_sites=2, identified=[[0, 1], [1, 2, 3]])
    first, second = make_site_data(cfg, 0), make_site_data(cfg, 1)
    assert first.identified.tolist() == [True, True, False, False]
    assert set(np.unique(first.train.labels)) == {-1, 0, 1}
    assert set(np.unique(second.train.labels)) == {-1, 1, 2, 3}


@pytest.mark.parametrize("identified, partition_scheme, message", [
    ([[0, 1]], "iid", "one non-empty list of class ids per site"),
    ([[0, 1], []], "iid", "one non-empty list of class ids per site"),
    ([[0, 1], [2, 3]], "labelset:2", "give only one"),
])
def test_bad_identified_lists_are_config_errors(identified: list, partition_scheme: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(num_sites=2, partition=partition_scheme, identified=identified)


def test_identified_class_outside_the_task_is_named() -> None:
    cfg = DataConfig(source="synthetic:n=200,classes=4,size=8", num_sites=2, identified=[[0, 1], [2, 7]])
    with pytest.raises(ConfigError, match=r"class\(es\) \[7\] outside \[0, 4\)"):
        make_site_data(cfg, 1)


def test_a_real_site_reads_its_identified_classes_from_its_own_file(tmp_path: Path) -> None:
    """POC/production: local/medflare_site.json lists the site's classes; the others become unknown."""
    (tmp_path / "medflare_site.json").write_text(json.dumps(
        {"data": {"source": "synthetic:n=120,classes=4,size=8", "identified": [2]}}))
    cfg = DataConfig(**read_site_data_config(tmp_path, {"source": "site"}))
    site = make_site_data(cfg, 0)
    assert site.identified.tolist() == [False, False, True, False]
    assert set(np.unique(site.train.labels)) == {-1, 2}
    with pytest.raises(ConfigError, match="list of class ids for this site"):
        DataConfig(source="synthetic", local=True, identified=[[2]])


def test_multi_label_refuses_options_that_need_class_ids() -> None:
    """Label noise, like-train eval splits, label fractions and the long-tail cut all work on class ids."""
    with pytest.raises(ConfigError, match="label_noise flips class ids"):
        make_site_data(DataConfig(source=ML_SOURCE, num_sites=2, label_noise=0.1), 0)
    with pytest.raises(ConfigError, match="like_train"):
        make_site_data(DataConfig(source=ML_SOURCE, num_sites=2, eval_split="like_train"), 0)
    with pytest.raises(ConfigError, match="label_fraction .* needs single-label data; set label_fraction to 1"):
        make_site_data(DataConfig(source=ML_SOURCE, num_sites=2, label_fraction=0.5), 0)
    with pytest.raises(ConfigError, match="label_fraction .* needs single-label data"):  # this site's share
        make_site_data(DataConfig(source=ML_SOURCE, num_sites=2, label_fraction=[1.0, 0.3]), 1)
    with pytest.raises(ConfigError, match="data.imbalance .* needs single-label data; set imbalance to 1"):
        make_site_data(DataConfig(source=ML_SOURCE, num_sites=2, imbalance=5), 0)


def test_multi_label_public_hold_out_keeps_the_sites_multi_label_and_disjoint() -> None:
    """A public share needs no labels, so it works on multi-label data; the sites keep multi-hot rows."""
    cfg = DataConfig(source=ML_SOURCE, num_sites=2, partition="labelset:3", public_fraction=0.25)
    sites = [make_site_data(cfg, i) for i in range(2)]
    public = sites[0].public.images
    assert (public.labels == -1).all() and len(public) == 150  # a quarter of the 600 training images
    for site in sites:
        assert site.multi_label and site.train.labels.shape[1] == 6 and site.identified.sum() == 3
    seen = [set(map(bytes, np.asarray(s.train.images.images).reshape(len(s.train), -1))) for s in sites]
    public_rows = set(map(bytes, np.asarray(public.images).reshape(len(public), -1)))
    assert not public_rows & (seen[0] | seen[1])


def test_multi_view_dataset_gives_every_view_of_the_same_image() -> None:
    site = make_site_data(DataConfig(source=ML_SOURCE, num_sites=2), 0)
    plain = build_transform(3, 12, train=False)
    views = MultiViewDataset(site.train, [plain, build_transform(3, 12, train=True, augment="strong"), plain])
    stacked, label = views[5]
    assert stacked.shape == (3, 3, 12, 12)
    assert torch.equal(stacked[0], stacked[2])
    assert torch.equal(stacked[0], site.val.transform(site.train.images.get_image(5)))
    assert torch.equal(label, torch.as_tensor(site.train.labels[5]))
