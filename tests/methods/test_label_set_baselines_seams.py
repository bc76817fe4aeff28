"""FedLSM's label-set baselines at their seams (issue 62), through the real paths: FedRS's restriction reads the
classes the site's data build left it, FedAvg*'s local step learns only from the labels the build kept, and its
masked classifier rows come out of the round core FLARE's aggregator drives, on the sites' own results."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from medflare import contracts
from medflare.data import DataConfig, make_site_data
from medflare.methods.base import TrainConfig
from medflare.methods.fedavg_masked import SPEC as MASKED_SPEC, FedAvgMaskedConfig
from medflare.methods.fedavg_masked.client import FedAvgMaskedTrainer
from medflare.methods.fedlsm.server import IDENTIFIED_KEY
from medflare.methods.fedrs import SPEC as FEDRS_SPEC, FedRsConfig
from medflare.methods.fedrs.client import FedRsTrainer
from medflare.plan import resolve
from medflare.run_config import RunConfig
from tests.benchmarks.conftest import load_benchmark

from .test_fedlsm import tiny_net

SINGLE = "synthetic:n=60,classes=3,size=8"
MULTI = "synthetic:multilabel=1,classes=4,n=60,size=8"


def labelset_site(source: str, site: int = 0):
    return make_site_data(DataConfig(source=source, partition="labelset:2", num_sites=2), site)


def first_batch(data, size: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = next(iter(DataLoader(data.train, batch_size=size, shuffle=False)))
    return images, labels


# ----- FedRS: the data option reaches the restriction -------------------------------------------------------------
def test_fedrs_restricts_exactly_the_classes_the_sites_data_build_left_unannotated() -> None:
    """FedRS (Li and Zhan, KDD 2021, Eq. 4; FedLSM paper §3.3 baseline (f)) on a FedLSM label-set site: the site's
    class counts come from the labels its build kept, so under the paper's hard restriction every class outside the
    site's annotated set, and only those, has its logit scaled by α in the local loss (cross-entropy here)."""
    data = labelset_site(SINGLE)
    cfg = FedRsConfig(alpha=0.3, restriction="hard", loss="ce")
    trainer = FedRsTrainer(tiny_net(data.num_classes), data, TrainConfig(batch_size=12), cfg, FEDRS_SPEC.payload,
                           torch.device("cpu"), log=lambda m: None)
    identified = np.asarray(data.identified, dtype=bool)
    np.testing.assert_array_equal(trainer.class_counts.numpy() > 0, identified)
    images, labels = first_batch(data)
    labelled = labels >= 0
    assert (~labelled).any() and labelled.any()
    trainer.model.eval()  # the same BatchNorm statistics for both forwards
    scales = torch.where(torch.as_tensor(identified), 1.0, 0.3)
    with torch.no_grad():
        expected = F.cross_entropy(trainer.model(images)[labelled] * scales, labels[labelled])
        loss = trainer.compute_loss(images, labels)
    torch.testing.assert_close(loss, expected)


# ----- FedAvg*: the local step learns only from the labels the data build kept ------------------------------------
@pytest.mark.parametrize("source", [SINGLE, MULTI])
def test_fedavg_masked_gets_no_gradient_from_a_label_the_site_does_not_annotate(source: str) -> None:
    """FedAvg* (FPSL's task-dependent aggregation, FedLSM Tables 1-2 *; spec §5(e)8) trains on the labelled data
    only: on a label-set site's own batch, the logits of an unannotated image (single-label) or of an unannotated
    entry (multi-label, the entries the build marked -1) get no gradient, every annotated one does."""
    data = labelset_site(source)
    trainer = FedAvgMaskedTrainer(tiny_net(data.num_classes), data, TrainConfig(batch_size=12), FedAvgMaskedConfig(),
                                  MASKED_SPEC.payload, torch.device("cpu"), log=lambda m: None)
    images, labels = first_batch(data)
    logits: list[torch.Tensor] = []
    forward = trainer.model.forward

    def keeping(x: torch.Tensor) -> torch.Tensor:
        out = forward(x)
        out.retain_grad()
        logits.append(out)
        return out

    trainer.model.forward = keeping
    trainer.model.train()
    trainer.compute_loss(images, labels).backward()
    gradient = logits[-1].grad
    unknown = labels < 0 if labels.dim() == 2 else (labels < 0)[:, None].expand_as(gradient)
    assert unknown.any() and (~unknown).any()
    assert torch.all(gradient[unknown] == 0)
    assert torch.all(gradient[~unknown] != 0)


# ----- FedAvg*: masked classifier rows through the round core ----------------------------------------------------
@pytest.fixture(scope="module")
def masked_round() -> tuple:
    engine: ModuleType = load_benchmark("inprocess")
    run = RunConfig(method="fedavg-masked", rounds=1, clients=2, model="cnn", site_evaluation="final",
                    data={"source": "synthetic:n=120,classes=3,n_val=8,n_test=8,size=16", "augment": "none",
                          "partition": "labelset:2"},
                    train={"batch_size": 12, "max_steps": 2, "lr": 0.01})
    plan = resolve(run, "byoc")
    rounds: list = []
    sites: dict = {}
    engine.run_rounds(plan, on_round=rounds.append, on_sites=lambda built: sites.update(built.sites))
    return rounds[0], sites


def test_fedavg_masked_rows_come_from_the_sites_annotating_each_class_in_the_round_core(masked_round: tuple) -> None:
    """Spec §5(e)8 (FPSL's task-dependent aggregation, inferred): on the round core FLARE's aggregator drives and the
    sites' own results, each site sends the classes its data build annotates, classifier row and bias entry c is
    Σ_k n_k·1[c ∈ I_k] ψ_{k,c} / Σ_j n_j·1[c ∈ I_j], and every other key is FedAvg by n_k."""
    done, sites = masked_round
    updates, params = done.accepted, done.aggregate.params
    for update in updates:
        np.testing.assert_array_equal(update.meta[IDENTIFIED_KEY], sites[update.site].data.identified.astype(float))
    mask = np.array([u.meta[IDENTIFIED_KEY] for u in updates], dtype=np.float64)
    n = np.array([float(u.meta[contracts.N_SAMPLES]) for u in updates])
    weights = n[:, None] * mask
    weights = np.where(weights.sum(axis=0) > 0, weights, n[:, None]) / np.where(
        weights.sum(axis=0) > 0, weights, n[:, None]).sum(axis=0)
    for key in ("head.weight", "head.bias"):
        rows = np.stack([u.arrays[key] for u in updates]).astype(np.float64)
        by_mask = np.einsum("sk,sk...->k...", weights, rows)
        np.testing.assert_allclose(params[key], by_mask, rtol=1e-5, atol=1e-6)
        assert np.abs(by_mask - np.einsum("s,s...->...", n / n.sum(), rows)).max() > 1e-4  # tells mask from n
    for key in (k for k in params if not k.startswith("head.") and params[k].dtype.kind == "f"):
        rows = np.stack([u.arrays[key] for u in updates]).astype(np.float64)
        np.testing.assert_allclose(params[key], np.einsum("s,s...->...", n / n.sum(), rows), rtol=1e-5, atol=1e-6)
