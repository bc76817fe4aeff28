"""Seams of the evaluation and of the data build (issue 62; fedavg/ledger.toml): the sites' evaluation statistics as
the controller combines them (each site's ``validate`` meta, ``RunResults.accept_site_result``, ``summarize``), and
data options checked on the labels the site's data build really produces, not on the option's value."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score, roc_auc_score

from medflare.data import DataConfig, make_site_data
from medflare.evaluation import summarize
from medflare.flare.run_results import RunResults, new_record
from medflare.methods.base import RoundContext
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

K = 4
SKEWED = {"source": f"synthetic:n=240,classes={K},size=8,n_val=40,n_test=80", "num_sites": 3,
          "partition": "dirichlet:0.3", "eval_split": "like_train", "min_size": 5}
FLOOR = 2  # the site policy's min_class_samples: a class with fewer test images at a site is left out of its counts


def _sites(data: dict[str, Any], min_class_samples: int = 0) -> list[SiteRuntime]:
    settings = SiteSettings(spec=get_method("fedavg"), task=TaskSpec(num_classes=K, in_channels=3, image_size=8),
                            data=data, model="cnn", train={"max_steps": 6, "batch_size": 8, "lr": 0.05},
                            min_class_samples=min_class_samples)
    return [SiteRuntime(settings, f"site-{i + 1}", i, log=lambda message: None) for i in range(data["num_sites"])]


def _kept(labels: np.ndarray, floor: int) -> np.ndarray:
    """The rows a site's counts keep under the policy floor (classes with 0 < n < floor are left out)."""
    counts = np.bincount(labels, minlength=K)
    return ~np.isin(labels, np.flatnonzero((counts > 0) & (counts < floor)))


@pytest.fixture(scope="module")
def scored() -> tuple[list[SiteRuntime], dict[str, Any]]:
    """Three skewed sites score one global model (site-1's after a short round) as the final validation does,
    and the controller's path combines what they send."""
    sites = _sites(SKEWED, FLOOR)
    sites[0].train({}, RoundContext(0, 1))
    global_arrays = sites[0].shared_weights()
    results, evaluations = RunResults("balanced_accuracy"), {}
    record = new_record(0, time.time())
    for site in sites:
        meta = site.validate(global_arrays)
        assert not results.accept_site_result(record, evaluations, site.site_name, meta, K, False)
    return sites, summarize(evaluations, None, share_cap=0.0)


def test_the_pooled_figures_are_the_pooled_predictions_and_the_site_mean_an_unweighted_mean(scored) -> None:
    """Pooled val/test: the metrics of every site's predictions put together (each image counts once, so a site
    weighs by its images); ``site_mean``: each site's test metric, averaged with equal weight per site. Balanced
    accuracy is the mean recall over the classes present in that test set (sklearn's ``balanced_accuracy_score``),
    never counting an absent class as 0 (the like_train sites lack classes they do not train on)."""
    sites, summary = scored
    per_site, pooled = [], {"val": ([], []), "test": ([], [])}
    for site in sites:
        for split in ("val", "test"):
            labels, probs, _ = site.trainer.predictions(split)
            keep = _kept(labels, FLOOR)
            pooled[split][0].append(labels[keep])
            pooled[split][1].append(probs[keep].argmax(1))
        labels, predicted = pooled["test"][0][-1], pooled["test"][1][-1]
        per_site.append(balanced_accuracy_score(labels, predicted))
    sizes = [len(labels) for labels in pooled["test"][0]]
    assert len(set(sizes)) == len(sizes) and any(len(np.unique(labels)) < K for labels in pooled["test"][0])
    for split, (labels, predicted) in pooled.items():
        expected = balanced_accuracy_score(np.concatenate(labels), np.concatenate(predicted))
        assert summary[split]["balanced_accuracy"] == pytest.approx(expected, abs=1e-12)
        assert summary[f"{split}_stats"]["count"] == sum(len(part) for part in labels)
    by_site = [summary["by_site"][site.site_name]["balanced_accuracy"] for site in sites]
    assert by_site == pytest.approx(per_site, abs=1e-12)
    assert summary["site_mean"]["balanced_accuracy"] == pytest.approx(float(np.mean(per_site)), abs=1e-12)
    assert abs(float(np.average(per_site, weights=sizes)) - float(np.mean(per_site))) > 1e-3  # the two means differ


def test_a_site_whose_metric_is_undefined_is_left_out_of_the_site_mean(scored) -> None:
    """A site whose kept test images are all of one class has no ROC AUC: the site mean of AUC averages the other
    sites only (None is not a 0), while the pooled AUC still counts its images."""
    sites, summary = scored
    aucs = {}
    for site in sites:
        labels, probs, _ = site.trainer.predictions("test")
        keep = _kept(labels, FLOOR)
        present = np.unique(labels[keep])
        aucs[site.site_name] = (None if len(present) < 2 else float(np.mean(
            [roc_auc_score(labels[keep] == k, probs[keep][:, k]) for k in present])))
    undefined = [name for name, auc in aucs.items() if auc is None]
    assert undefined and summary["by_site"][undefined[0]]["auc_macro_ovr"] is None
    defined = [auc for auc in aucs.values() if auc is not None]
    assert summary["site_mean"]["auc_macro_ovr"] == pytest.approx(float(np.mean(defined)), abs=5e-3)


# ----- data options, read off the labels the site's data build produces ----------------------------------------
def _site_data(num_sites: int = 4, **options: Any) -> list[Any]:
    cfg = DataConfig(**{"source": f"synthetic:n=400,classes={K},size=8,n_val=40,n_test=120", "num_sites": num_sites,
                        "min_size": 5, **options})
    return [make_site_data(cfg, index) for index in range(num_sites)]


def _test_counts(sites: list[Any]) -> np.ndarray:
    return np.stack([np.bincount(site.test.labels, minlength=K) for site in sites])


def test_eval_split_like_train_gives_each_site_a_test_set_in_its_training_class_mix() -> None:
    """eval_split=like_train (FCA §4.2: each client's test set follows its class mix): a site's test counts are
    its share of each class of the test split in proportion to its training counts (none of a class it does not
    train on), and the sites' tests tile the test split; eval_split=pooled gives every site a stratified IID slice
    whatever its training mix."""
    skew = {"partition": "dirichlet:0.2", "seed": 3}
    like = _site_data(eval_split="like_train", **skew)
    train = np.stack([site.class_counts for site in like]).astype(float)
    test = _test_counts(like)
    total = test.sum(axis=0)
    whole = np.bincount(_site_data(num_sites=1)[0].test.labels, minlength=K)  # one site holds the whole split
    assert (train == 0).any() and np.array_equal(total, whole)
    expected = train / train.sum(axis=0) * total
    assert np.all(np.abs(test - expected) <= 1.0 + 1e-9)
    assert np.all(test[train == 0] == 0)
    pooled = _test_counts(_site_data(eval_split="pooled", **skew))
    assert np.array_equal(pooled.sum(axis=0), total)
    assert np.all(pooled.max(axis=0) - pooled.min(axis=0) <= 1)


def _largest_class_share(sites: list[Any]) -> float:
    """The mean over sites of the share of the site's most frequent training class."""
    return float(np.mean([site.class_counts.max() / site.class_counts.sum() for site in sites]))


def test_the_dirichlet_alpha_sets_how_skewed_each_sites_training_labels_are() -> None:
    """partition=dirichlet:ALPHA (spec §1.2, FedML's partitioner): each class is dealt over sites by shares drawn
    from Dir(ALPHA). With ALPHA = 100 every site holds about 1/K of each class; with ALPHA = 0.1 most of a site's
    labels are one or two classes. Measured on the class counts the sites' data build gives them."""
    near_iid = _site_data(partition="dirichlet:100")
    skewed = _site_data(partition="dirichlet:0.1")
    assert _largest_class_share(near_iid) < 0.33  # K = 4: a uniform site's largest share is 0.25
    assert _largest_class_share(skewed) > 0.6
    shares = np.stack([site.class_counts for site in near_iid]) / sum(site.class_counts for site in near_iid)
    assert np.all(np.abs(shares - 1 / 4) < 0.12)  # every class is split about evenly over the 4 sites


def test_imbalance_cuts_the_training_pool_to_the_ratio_and_leaves_the_test_split_whole() -> None:
    """data.imbalance = IR: the sites' training pool (their class counts added up) has its largest class IR times
    its smallest (up to rounding), while val and test keep the source's split (metrics stay comparable)."""
    sites = _site_data(num_sites=2, imbalance=10.0)
    pool = sum(site.class_counts for site in sites)
    assert pool.max() / pool.min() == pytest.approx(10.0, rel=0.1)
    assert sum(len(site.test) for site in sites) == 120
    whole = sum(site.class_counts for site in _site_data(num_sites=2))
    assert whole.max() / whole.min() < 1.5


def test_a_labelset_site_trains_only_on_its_identified_classes_and_is_tested_on_all() -> None:
    """partition=labelset:2 (spec §5, label-set mismatch): each site annotates 2 classes; the other classes'
    training images stay but unlabelled (-1), its class counts are 0 there, and its test split keeps every class."""
    for site in _site_data(num_sites=2, partition="labelset:2"):
        labels = np.asarray(site.train.labels)
        assert site.identified.sum() == 2
        assert set(np.unique(labels[labels >= 0])) == set(np.flatnonzero(site.identified))
        assert (labels == -1).any() and np.all(site.class_counts[~site.identified] == 0)
        assert len(np.unique(site.test.labels)) == K
