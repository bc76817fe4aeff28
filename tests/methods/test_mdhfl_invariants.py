"""MDH-FL's and FedMD's ledger invariants (methods/mdhfl/ledger.toml, methods/fedmd/ledger.toml) that no other fast
test pinned: the local and CCR losses against hand-computed SCE and CE, the private-loss pass leaving the model as it
was, the KL steps against a hand-computed cross-entropy to T_p, CCR's relative drops, FedMD's consensus."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from medflare.data import DataConfig, make_site_data
from medflare.methods.base import RoundContext, TrainConfig
from medflare.methods.mdhfl.protocol import (
    DISTILL_PHASE,
    KL_LOSS,
    PRIVATE_LOSS,
    PROBS,
    PROBS_PHASE,
    PUBLIC_DIGEST,
    PUBLIC_ROWS,
    PUBLIC_SIZE,
    SETUP_PHASE,
    TARGET,
)
from medflare.methods.mdhfl.targets import ccr_weights
from medflare.models import create_model
from medflare.registry import get_method
from medflare.server_round import RoundAggregation

K = 3
DIGEST = "ab" * 32
LABEL_FLOOR_LOG = math.log(1e-4)  # SCE's reverse term: log of the clamped one-hot's zeros (spec §1, item 4)


def site_trainer(method: str = "mdhfl", **method_args):
    cfg = DataConfig(source=f"synthetic:n=60,classes={K},size=12,n_val=9,n_test=9", num_sites=2,
                     public_fraction=0.4, augment="none")
    spec = get_method(method)
    torch.manual_seed(0)
    model = create_model("cnn", K, 3, image_size=12)
    train = TrainConfig(**{**spec.train_defaults, "batch_size": 8})
    return spec.trainer_cls(model, make_site_data(cfg, 0), train, spec.config_cls(**method_args), spec.payload,
                            torch.device("cpu"), log=lambda m: None)


def private_rows(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*DataLoader(trainer.data.train, batch_size=len(trainer.data.train)))
    return images[0], labels[0]


def hand_ce(logits: torch.Tensor, labels: torch.Tensor) -> float:
    probs = torch.softmax(logits.double(), dim=1)
    return float(-probs[torch.arange(len(labels)), labels].log().mean())


def hand_sce(logits: torch.Tensor, labels: torch.Tensor, alpha: float, beta: float) -> float:
    """α·CE + β·RCE, RCE = −log(1e-4)·Σ_{k≠y} clamp(p_k, 1e-7, 1) per row (spec §1, item 4), averaged."""
    probs = torch.softmax(logits.double(), dim=1).clamp(min=1e-7)
    others = probs.sum(1) - probs[torch.arange(len(labels)), labels]
    return alpha * hand_ce(logits, labels) + beta * float((-LABEL_FLOOR_LOG * others).mean())


# ----- the local loss and CCR's statistic ------------------------------------------------------------------------
# The defaults (0.1, 1.0) and a pair with beta != 1, so that the options themselves reach the loss.
SCE_WEIGHTS = [pytest.param({}, 0.1, 1.0, id="defaults"), pytest.param({"sce_alpha": 0.7, "sce_beta": 0.25}, 0.7, 0.25,
                                                                      id="alpha0.7-beta0.25")]


@pytest.mark.parametrize("method_args, alpha, beta", SCE_WEIGHTS)
def test_local_loss_is_sce_with_alpha_on_ce_and_beta_on_reverse_ce(method_args: dict, alpha: float,
                                                                    beta: float) -> None:
    trainer = site_trainer(**method_args)
    trainer.model.eval()  # the same forward for the loss and the reference (no batch statistics)
    images, labels = private_rows(trainer)
    with torch.no_grad():
        logits = trainer.model(images)
        loss = float(trainer.compute_loss(images, labels))
    assert loss == pytest.approx(hand_sce(logits, labels, alpha=alpha, beta=beta), rel=1e-5)
    assert abs(loss - hand_ce(logits, labels)) > 0.1  # not plain CE (the "w/o SCE" ablation)


@pytest.mark.parametrize("method_args, alpha, beta", SCE_WEIGHTS)
def test_the_private_loss_is_the_eval_mode_sce_over_the_private_rows(method_args: dict, alpha: float,
                                                                      beta: float) -> None:
    trainer = site_trainer(**method_args)
    images, labels = private_rows(trainer)
    trainer.model.eval()
    with torch.no_grad():
        expected = hand_sce(trainer.model(images), labels, alpha=alpha, beta=beta)
    _, meta = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, RoundContext(0, 2))
    assert meta[PRIVATE_LOSS] == pytest.approx(expected, rel=1e-5)


def test_the_probabilities_phase_leaves_the_model_untouched_without_a_graph() -> None:
    """Spec §3(a) step 1: the CCR pass in eval mode with no_grad (the code's train mode moves BatchNorm's stats)."""
    trainer = site_trainer()
    calls: list[tuple[bool, bool]] = []
    trainer.model.register_forward_hook(lambda module, i, o: calls.append((module.training, torch.is_grad_enabled())))
    before = copy.deepcopy(trainer.model.state_dict())
    _, meta = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, RoundContext(0, 2))
    assert PRIVATE_LOSS in meta and len(calls) >= 2  # the public chunk and the private rows
    assert calls == [(False, False)] * len(calls)
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[key]), key


# ----- the KL steps ---------------------------------------------------------------------------------------------
def test_kl_steps_minimise_the_cross_entropy_to_the_target() -> None:
    trainer = site_trainer()
    ctx = RoundContext(0, 2)
    arrays, _ = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, ctx)  # one batch of 8 rows
    target = np.zeros((8, K), np.float16)
    target[:, 1] = 0.75  # a row sum s_p < 1, as a T_p of the others' weights
    reference = copy.deepcopy(trainer.model).train()
    images = torch.stack([trainer.data.public[i][0] for i in range(8)])
    with torch.no_grad():
        log_probs = torch.log_softmax(reference(images).double(), dim=1)
    expected = float(-(torch.as_tensor(target, dtype=torch.float64) * log_probs).sum(1).mean())
    _, meta = trainer.run_phase(DISTILL_PHASE, {TARGET: target}, ctx)
    assert meta[KL_LOSS] == pytest.approx(expected, rel=1e-4)
    for _ in range(4):
        trainer.run_phase(DISTILL_PHASE, {TARGET: target}, ctx)
    after, _ = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, ctx)
    assert after[PROBS][:, 1].astype(np.float64).mean() > arrays[PROBS][:, 1].astype(np.float64).mean() + 0.004


# ----- CCR -------------------------------------------------------------------------------------------------------
def test_ccr_drops_are_relative_to_the_current_loss() -> None:
    """q_p = (L^{e−1} − L^e) / L^e (spec §3(a) step 2): two different drops keep their ratio after Σq."""
    weights = ccr_weights(["a", "b", "c"], {"a": 2.0, "b": 1.5, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, beta=0.5)
    # q = (1, 0.5, 0), Σq = 1.5: a = 1/2 + 0.5·(2/3, 1/3, 0)
    logits = np.array([0.5 + 1 / 3, 0.5 + 1 / 6, 0.5])
    expected = np.exp(logits) / np.exp(logits).sum()
    assert [weights[s] for s in "abc"] == pytest.approx(expected.tolist(), abs=1e-12)


# ----- the server's targets: MDH-FL against FedMD -------------------------------------------------------------------
def first_targets(method: str) -> dict[str, np.ndarray]:
    """Round 0 of the exchange, three sites each sending a one-hot column of its own: each site's target."""
    core = RoundAggregation(get_method(method), {"public_per_round": 4}, num_classes=K, num_rounds=2)
    core.start_round({}, RoundContext(0, 2))
    core.start_phase(SETUP_PHASE)
    sites = ("site-1", "site-2", "site-3")
    for site in sites:
        assert core.accept(site, {}, {PUBLIC_DIGEST: DIGEST, PUBLIC_SIZE: 8}) is None
    rows = int(core.start_phase(PROBS_PHASE)[PUBLIC_ROWS][1])
    for column, site in enumerate(sites):
        probs = np.zeros((rows, K), np.float32)
        probs[:, column] = 1.0
        assert core.accept(site, {PROBS: probs}, {PRIVATE_LOSS: 1.0} if method == "mdhfl" else {}) is None
    return {site: arrays[TARGET].astype(np.float64) for site, arrays in core.start_phase("train").arrays.items()}


def test_mdhfl_targets_mix_only_the_other_sites() -> None:
    targets = first_targets("mdhfl")  # round 0: w = 1/(P−1) for each other site
    np.testing.assert_allclose(targets["site-1"], np.tile([0.0, 0.5, 0.5], (4, 1)), atol=1e-6)
    np.testing.assert_allclose(targets["site-3"], np.tile([0.5, 0.5, 0.0], (4, 1)), atol=1e-6)


def test_fedmd_distils_towards_the_mean_of_every_site_its_own_included() -> None:
    targets = first_targets("fedmd")
    assert set(targets) == {"site-1", "site-2", "site-3"}
    for target in targets.values():
        np.testing.assert_allclose(target, np.full((4, K), 1 / 3), atol=1e-6)


# ----- FedMD's site ------------------------------------------------------------------------------------------------
def test_fedmd_revisits_private_data_with_plain_cross_entropy() -> None:
    trainer = site_trainer("fedmd")
    trainer.model.eval()
    images, labels = private_rows(trainer)
    with torch.no_grad():
        logits = trainer.model(images)
        loss = float(trainer.compute_loss(images, labels))
    assert loss == pytest.approx(hand_ce(logits, labels), rel=1e-5)


def test_fedmd_keeps_one_adam_across_its_kl_steps() -> None:
    trainer = site_trainer("fedmd")
    ctx = RoundContext(0, 2)
    for first in (0, 16):
        trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([first, 8])}, ctx)
        trainer.run_phase(DISTILL_PHASE, {TARGET: np.full((8, K), 1 / K, np.float16)}, ctx)
    assert isinstance(trainer.kl_optimizer, torch.optim.Adam)
    assert {int(s["step"]) for s in trainer.kl_optimizer.state_dict()["state"].values()} == {2}
