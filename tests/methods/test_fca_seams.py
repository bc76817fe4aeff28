"""FCA's seams (issue 62): generalization and specialization as the controller computes them from real sites'
evaluation counts, each site's test split following its training class mix, and every value of ``--preset paper``
against the paper's training details."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medflare.evaluation import SPECIALIZATION
from medflare.methods.fca import SPEC, FcaConfig

from ._seams import (
    LONG_TAIL_MISSING,
    balanced_accuracy,
    built_train_counts,
    final_summary,
    paper_run,
    site_runtime,
    split_tensors,
)

FCA_DATA = {**LONG_TAIL_MISSING, "eval_split": "like_train"}  # FCA's protocol (paper §4.2; FCA_PROTOCOL_DATA)


def fca_sites() -> list:
    return [site_runtime("fca", FCA_DATA, index, train={"batch_size": 32})
            for index in range(FCA_DATA["num_sites"])]


def predicted(runtime, split: str, personal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(labels, argmax) of the site's model on one split, with its personal or its federated head."""
    images, labels = split_tensors(runtime.trainer, split)
    model = runtime.model.eval()
    with torch.no_grad():
        federated, own = model.forward_both(images.to(runtime.device))
    return labels, (own if personal else federated).argmax(dim=1).cpu().numpy()


def test_generalization_pools_the_union_of_test_sets_and_specialization_averages_the_sites() -> None:
    """FCA paper §4.2 'Settings' and 'FCA evaluation': specialization = (1/K) Σ_k bACC(D_test^k) of each client's
    personalized head on its own test set; generalization = bACC of the federated classifier on the aggregated test set
    Σ_k D_test^k (one pool, not a mean of per-site scores); and the average of the two. Checked on the figures the
    server rule makes of the controller's summary of three real sites' evaluation counts."""
    runtimes = fca_sites()
    own = {rt.site_name: balanced_accuracy(*predicted(rt, "test", personal=True)) for rt in runtimes}
    summary = final_summary(runtimes, runtimes[0].shared_weights())  # scores the own models, then loads the global
    pooled = [predicted(rt, "test", personal=False) for rt in runtimes]
    generalization = balanced_accuracy(np.concatenate([p[0] for p in pooled]), np.concatenate([p[1] for p in pooled]))
    per_site_global = [balanced_accuracy(*p) for p in pooled]
    figures = SPEC.server_rule_cls(FcaConfig(), 10, SPEC.payload).final_metrics(summary)
    assert figures["specialization_by_site"] == {site: {"bacc": pytest.approx(v), "bauc": pytest.approx(
        summary["extra"][SPECIALIZATION]["by_site"][site]["bauc"])} for site, v in own.items()}
    assert figures["specialization_bacc"] == pytest.approx(np.mean(list(own.values())))
    assert figures["generalization_bacc"] == pytest.approx(generalization)
    assert figures["gs_mean_bacc"] == pytest.approx((generalization + np.mean(list(own.values()))) / 2)
    # the cases tell the rules apart: a median is not the mean, a pool is not a mean of sites
    assert len(set(np.round(list(own.values()), 6))) == 3
    assert np.median(list(own.values())) != pytest.approx(np.mean(list(own.values())))
    assert generalization != pytest.approx(np.mean(per_site_global))


def test_each_sites_test_split_follows_its_training_class_mix_and_the_splits_tile_the_pool() -> None:
    """FCA paper §4.1-4.2 (each client's test set has its own class distribution; some clients lack classes) as spec
    §6(d) and FCA_PROTOCOL_DATA give it: a site's test split holds no image of a class its training split lacks, and
    the sites' test splits together are the whole pooled test split (the generalization set)."""
    runtimes = fca_sites()
    for rt in runtimes:
        lacking = built_train_counts(rt.trainer) == 0
        test_counts = np.bincount(np.asarray(rt.data.test.labels), minlength=len(lacking))
        assert lacking.any() and not test_counts[lacking].any(), rt.site_name
        assert (test_counts[~lacking] > 0).all(), rt.site_name
    assert sum(len(rt.data.test) for rt in runtimes) == 300  # synthetic:n=600 has a 300-image test split


# Paper §4.1 'Training Details' and 'Network architectures', Table 7 (λ₁ = 1, λ₂ = 3 best), §3 Eq. 5 (consistency
# weight 1), spec §6(c)/(e)1 (KL at T = 1), §4.2 (each client's own test set); Fed-ISIC2019's 6 centres (Table 1)
PAPER_TABLE = {
    "model": "efficientnet_b0", "clients": 6, "rounds": 80,
    "data": {"image_size": 224, "eval_split": "like_train"},
    "train": {"optimizer": "adam", "lr": 1e-3, "weight_decay": 5e-4, "batch_size": 64, "local_epochs": 1,
              "lr_schedule": "multistep", "milestones": [60, 70], "gamma": 0.1},
    "method_args": {"lambda_fed": 1.0, "lambda_personal": 3.0, "consistency": "kl", "consistency_weight": 1.0,
                    "temperature": 1.0},
}


def test_every_value_of_the_paper_preset_is_the_papers_and_reaches_the_run() -> None:
    """FCA paper §4.1: EfficientNet-B0, 80 rounds, Adam lr 1e-3, weight decay 5e-4, batch 64, lr × 0.1 at rounds 60
    and 70, one local epoch; Table 7: λ₁ = 1, λ₂ = 3; Eq. 5: consistency weight 1; 6 Fed-ISIC2019 centres; each
    client's test set its own (§4.2). Every preset value is read here, and each reaches the typed run, the site's
    TrainConfig and the method's options."""
    preset = SPEC.presets["paper"].overrides
    assert dict(preset) == PAPER_TABLE  # no preset value goes unread
    run, train, cfg = paper_run("fca")
    assert (run.model, run.clients, run.rounds) == ("efficientnet_b0", 6, 80)
    assert {key: run.data[key] for key in PAPER_TABLE["data"]} == PAPER_TABLE["data"]
    for key, value in PAPER_TABLE["train"].items():
        assert getattr(train, key) == (tuple(value) if isinstance(value, list) else value), key
    for key, value in PAPER_TABLE["method_args"].items():
        assert getattr(cfg, key) == value, key
