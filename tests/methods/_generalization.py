"""FCA's generalization of a method without a global classifier, checked by hand on a tiny simulated job (shared by
the FedRep and local-only tests; not collected: no ``test_`` prefix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medflare.data import DataConfig, make_site_data
from medflare.evaluation import GENERALIZATION, site_evaluation, summarize
from medflare.methods.base import RoundContext
from medflare.metrics import EvalStats, compute_metrics
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

CLASSES = 3
DATA = {"source": "synthetic:n=150,classes=3", "num_sites": 2, "partition": "dirichlet:0.5",
        "eval_split": "like_train", "min_size": 5}


def trained_sites(method: str) -> list[SiteRuntime]:
    """Two simulated sites of ``method``, each after one local round (cnn, one step of batch 8)."""
    settings = SiteSettings(spec=get_method(method), task=TaskSpec(num_classes=CLASSES, in_channels=3, image_size=28),
                            data=DATA, model="cnn", train={"max_steps": 1, "batch_size": 8},
                            method_args={"head_epochs": 1} if method == "fedrep" else {})
    sites = [SiteRuntime(settings, f"site-{i + 1}", i, log=lambda message: None) for i in range(2)]
    for site in sites:
        site.train({}, RoundContext(0, 1))
    return sites


def pooled_test_by_hand() -> tuple[torch.Tensor, np.ndarray]:
    """Both sites' test slices, concatenated in site order: images and labels."""
    slices = [make_site_data(DataConfig(**{**DATA, "num_classes": CLASSES}), i).test for i in range(2)]
    images = torch.stack([image for part in slices for image, _ in part])
    labels = np.concatenate([part.labels for part in slices])
    return images, labels


def own_model_on(site: SiteRuntime, images: torch.Tensor, labels: np.ndarray) -> dict:
    """bACC and bAUC of the site's own model (as its last local training left it) on the given images."""
    site.model.eval()
    with torch.no_grad():
        probs = torch.softmax(site.model(images).double(), dim=1).numpy()
    return compute_metrics(EvalStats.from_predictions(labels, probs, CLASSES))


def final_figures(method: str, sites: list[SiteRuntime]) -> tuple[dict, dict]:
    """What each site sends in the final validate task, and the method's final figures from those."""
    metas = {site.site_name: site.validate({}) for site in sites}
    final = summarize({name: site_evaluation(meta, CLASSES) for name, meta in metas.items()})
    spec = get_method(method)
    rule = spec.server_rule_cls(spec.config_cls(), 1, spec.payload)
    return metas, rule.final_metrics(final)


def check_generalization_by_hand(method: str) -> None:
    """generalization_* = the mean over sites of each site's own model on the pooled test set, computed by hand."""
    sites = trained_sites(method)
    images, labels = pooled_test_by_hand()
    assert len(labels) > max(len(site.data.test) for site in sites)  # the pool, not one site's slice
    assert [label for _, label in sites[0].data.pooled_test] == labels.tolist()
    by_hand = [own_model_on(site, images, labels) for site in sites]
    metas, figures = final_figures(method, sites)
    assert all(GENERALIZATION in meta["eval_extra"] for meta in metas.values())
    for metric, short in (("balanced_accuracy", "bacc"), ("bauc", "bauc")):
        expected = float(np.mean([scores[metric] for scores in by_hand]))
        assert figures[f"generalization_{short}"] == pytest.approx(expected, abs=1e-12)
        assert figures[f"gs_mean_{short}"] == pytest.approx((expected + figures[f"specialization_{short}"]) / 2)
    bacc = figures["generalization_by_site"]["site-2"]["bacc"]
    assert bacc == pytest.approx(by_hand[1]["balanced_accuracy"], abs=1e-12)
