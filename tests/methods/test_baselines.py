"""FedAvg, BSM-FL and FedProx site updates against hand-written float64 references."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medflare.contracts import Payload
from medflare.methods.base import RoundContext, TrainConfig
from medflare.registry import get_method

from .conftest import make_site


def trainer_for(method: str, model, site, **train):
    spec = get_method(method)
    cfg = TrainConfig(optimizer="sgd", momentum=0.0, lr=0.1, batch_size=len(site.train), **train)
    return spec.trainer_cls(model, site, cfg, spec.config_cls(), spec.payload, torch.device("cpu"), log=lambda m: None)


def full_batch(site):
    return site.train.tensors


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_fedprox_two_sgd_steps_match_reference(mu: float, site, linear) -> None:
    # Prepare: full-batch SGD, 2 steps; the proximal pull only acts once weights have moved from w_global.
    spec = get_method("fedprox")
    cfg = TrainConfig(optimizer="sgd", momentum=0.0, lr=0.1, batch_size=len(site.train), local_epochs=2)
    trainer = spec.trainer_cls(linear, site, cfg, spec.config_cls(mu=mu), spec.payload, torch.device("cpu"), lambda m: None)
    w, b = linear.weight.detach().clone(), linear.bias.detach().clone()
    wg, bg = w.clone(), b.clone()
    x, y = full_batch(site)
    for _ in range(2):  # reference: plain autograd on a functional copy
        w.requires_grad_(True), b.requires_grad_(True)
        loss = F.cross_entropy(x @ w.T + b, y) + mu / 2 * ((w - wg).pow(2).sum() + (b - bg).pow(2).sum())
        gw, gb = torch.autograd.grad(loss, (w, b))
        w, b = (w - 0.1 * gw).detach(), (b - 0.1 * gb).detach()
    # Execute
    trainer.train_round(RoundContext(0, 1))
    # Assert
    torch.testing.assert_close(linear.weight.detach(), w)
    torch.testing.assert_close(linear.bias.detach(), b)


def test_fedprox_pulls_towards_the_model_received_this_round(site, linear) -> None:
    # Prepare: after round 0 a new global model arrives; the local weights then move off it (as mid-round 1).
    spec = get_method("fedprox")
    cfg = TrainConfig(optimizer="sgd", momentum=0.0, lr=0.1, batch_size=len(site.train))
    trainer = spec.trainer_cls(linear, site, cfg, spec.config_cls(mu=0.5), spec.payload, torch.device("cpu"),
                               lambda m: None)
    trainer.train_round(RoundContext(0, 2))
    rng = np.random.default_rng(7)
    received = {"weight": rng.normal(size=(3, 4)), "bias": rng.normal(size=3)}
    trainer.receive(received)
    trainer.on_round_start(RoundContext(1, 2))
    with torch.no_grad():
        linear.weight.add_(0.3)
    x, y = full_batch(site)
    wg, bg = (torch.as_tensor(received[k]) for k in ("weight", "bias"))
    squared = (linear.weight.detach() - wg).pow(2).sum() + (linear.bias.detach() - bg).pow(2).sum()
    expected = F.cross_entropy(linear(x), y) + 0.5 / 2 * squared
    # Execute
    loss = trainer.compute_loss(x, y)
    # Assert
    torch.testing.assert_close(loss, expected)


def test_bsm_fl_leaves_unlabelled_samples_out_of_the_loss_and_the_prior(linear) -> None:
    site = make_site(labels=[0, 0, -1, 1, 0, -1, 1, 0, 0, -1, 0, 1])  # 6 of class 0, 3 of class 1, 3 unlabelled
    trainer = trainer_for("bsm-fl", linear, site)
    x, y = full_batch(site)
    keep = y >= 0
    prior = torch.tensor([6 / 9, 3 / 9, 0.0], dtype=torch.float64)
    expected = F.cross_entropy(linear(x[keep]) + torch.log(prior + 1e-12), y[keep])
    torch.testing.assert_close(trainer.compute_loss(x, y).double(), expected, rtol=1e-5, atol=1e-6)


def test_bsm_fl_loss_is_ce_on_prior_shifted_logits(linear) -> None:
    site = make_site(labels=[0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1])  # class 2 absent at this site
    trainer = trainer_for("bsm-fl", linear, site)
    x, y = full_batch(site)
    prior = torch.tensor([8 / 12, 4 / 12, 0.0], dtype=torch.float64)
    expected = F.cross_entropy(linear(x) + torch.log(prior + 1e-12), y)
    torch.testing.assert_close(trainer.compute_loss(x, y).double(), expected, rtol=1e-5, atol=1e-6)


def test_unlabelled_samples_are_ignored_and_not_counted(linear) -> None:
    site = make_site(labels=[0, 1, 2, -1, -1, -1, 0, 1, 2, -1, -1, -1])
    trainer = trainer_for("fedavg", linear, site)
    meta = trainer.train_round(RoundContext(0, 1))
    assert meta["n_samples"] == 6
    x, y = full_batch(site)
    keep = y >= 0
    torch.testing.assert_close(trainer.compute_loss(x, y), F.cross_entropy(linear(x[keep]), y[keep]))


def test_max_steps_caps_the_round(site, linear) -> None:
    trainer = trainer_for("fedavg", linear, site, local_epochs=5, max_steps=2)
    trainer.train_cfg.batch_size = 4  # 3 batches per epoch
    steps = []
    trainer.after_step = lambda: steps.append(1)
    trainer.train_round(RoundContext(0, 1))
    assert len(steps) == 2


def test_optimizer_state_persists_across_rounds(site, linear) -> None:
    trainer = trainer_for("fedavg", linear, site)
    trainer.train_cfg.optimizer = "adam"
    trainer.train_round(RoundContext(0, 2))
    first = trainer.optimizer
    trainer.train_round(RoundContext(1, 2))
    assert trainer.optimizer is first and first.state  # Adam moments kept, never sent


def test_receive_never_overwrites_private_keys(site, linear) -> None:
    trainer = trainer_for("fedavg", linear, site)
    trainer.payload = Payload(private_keys=r"^bias$")
    before = linear.bias.detach().clone()
    trainer.receive({"weight": np.zeros((3, 4)), "bias": np.full(3, 7.0)})
    assert torch.all(linear.weight == 0)
    torch.testing.assert_close(linear.bias.detach(), before)
    assert set(trainer.outgoing_arrays()) == {"weight"}


def test_cosine_schedule_reaches_the_floor_on_the_last_round() -> None:
    from medflare.methods.base import round_lr

    cfg = TrainConfig(lr=0.1, lr_schedule="cosine", min_lr=1e-4)
    assert round_lr(cfg, RoundContext(9, 10)) == pytest.approx(1e-4)
    assert round_lr(cfg, RoundContext(0, 10)) == pytest.approx(1e-4 + 0.5 * (0.1 - 1e-4) * (1 + np.cos(np.pi / 10)))
