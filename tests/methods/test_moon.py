"""MOON against hand-written float64 references; the frozen copies stay at the site and take no gradient."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from medflare.contracts import ContractContext
from medflare.errors import ConfigError
from medflare.methods.base import LocalTrainer, RoundContext
from medflare.methods.moon import SPEC, MoonConfig  # importing the package registers 'moon'
from medflare.methods.moon.client import model_contrastive_loss
from medflare.models import Classifier

from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

LABELS = [0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, 0]  # two unlabelled samples: out of CE, still in the contrastive term


def numpy_contrastive(z: np.ndarray, z_global: np.ndarray, z_previous: np.ndarray, tau: float) -> float:
    """−log(e^{cos(z, zg)/τ} / (e^{cos(z, zg)/τ} + e^{cos(z, zp)/τ})), averaged over rows."""

    def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    positive, negative = np.exp(cos(z, z_global) / tau), np.exp(cos(z, z_previous) / tau)
    return float(np.mean(-np.log(positive / (positive + negative))))


def numpy_features(state: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The tiny classifier's pooled features tanh(x W1ᵀ + b1) from a state dict."""
    return np.tanh(x @ state["backbone.0.weight"].T + state["backbone.0.bias"])


def numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """A detached numpy copy of the module's state dict."""
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def assert_same_state(module: torch.nn.Module, state: dict[str, np.ndarray]) -> None:
    """Every state-dict entry of ``module`` equals ``state``."""
    for key, value in module.state_dict().items():
        np.testing.assert_array_equal(value.detach().numpy(), state[key], err_msg=key)


@pytest.fixture
def moon_site() -> SimpleNamespace:
    return make_site(labels=LABELS)


def trained_one_round(site: SimpleNamespace, mu: float = 0.7) -> tuple[LocalTrainer, Classifier]:
    """A MOON trainer after round 0 of 3, and its model."""
    model = tiny_classifier()
    trainer = make_trainer("moon", model, site, MoonConfig(mu=mu))
    trainer.train_round(RoundContext(0, 3))
    return trainer, model


def perturbed(state: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """A stand-in for the next global model: the state plus small seeded noise."""
    rng = np.random.default_rng(seed)
    return {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in state.items()}


def test_contrastive_term_by_hand() -> None:
    # Prepare: row 1 cos(z, zg) = 1/√2, cos(z, zp) = 0; row 2 cos(z, zg) = 1, cos(z, zp) = 0; τ = 0.5.
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    z_global = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    z_previous = torch.tensor([[0.0, 1.0], [3.0, 0.0]], dtype=torch.float64)
    expected = 0.5 * (math.log(1 + math.exp(-math.sqrt(2))) + math.log(1 + math.exp(-2)))
    # Execute
    loss = model_contrastive_loss(z, z_global, z_previous, temperature=0.5)
    # Assert
    assert loss.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tau", [0.5, 0.1])
def test_contrastive_term_matches_the_formula(tau: float) -> None:
    # Prepare
    rng = np.random.default_rng(1)
    z, z_global, z_previous = (rng.standard_normal((6, 5)) for _ in range(3))
    # Execute
    loss = model_contrastive_loss(*(torch.from_numpy(a) for a in (z, z_global, z_previous)), temperature=tau)
    # Assert
    assert loss.item() == pytest.approx(numpy_contrastive(z, z_global, z_previous, tau), rel=1e-10)


def test_round_zero_has_no_previous_model_and_trains_on_ce_only(moon_site) -> None:
    # Prepare
    model = tiny_classifier()
    trainer = make_trainer("moon", model, moon_site)
    x, y = moon_site.train.tensors
    keep = y >= 0
    # Execute
    trainer.on_round_start(RoundContext(0, 3))
    loss = trainer.compute_loss(x, y)
    unlabelled_only = trainer.compute_loss(x[~keep], y[~keep])
    # Assert
    assert trainer.previous_model is None
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(model(x[keep]), y[keep]))
    assert unlabelled_only.item() == 0.0  # no label in the batch: zero, not NaN


def test_loss_matches_reference_with_previous_model(moon_site) -> None:
    # Prepare: after round 0, receive a new global model, then move the local weights off it (as mid-round).
    trainer, model = trained_one_round(moon_site, mu=0.7)
    previous = numpy_state(model)
    received = perturbed(previous, seed=2)
    trainer.receive(received)
    trainer.on_round_start(RoundContext(1, 3))
    with torch.no_grad():
        model.backbone[0].weight.add_(0.05)
    current = numpy_state(model)
    x, y = (t.numpy() for t in moon_site.train.tensors)
    keep = y >= 0
    z = numpy_features(current, x)
    logits = z @ current["head.weight"].T + current["head.bias"]
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ce = -log_probs[keep][np.arange(keep.sum()), y[keep]].mean()
    contrastive = numpy_contrastive(z, numpy_features(received, x), numpy_features(previous, x), tau=0.5)
    # Execute
    loss = trainer.compute_loss(*moon_site.train.tensors)
    # Assert
    assert loss.item() == pytest.approx(ce + 0.7 * contrastive, rel=1e-10)


def test_previous_model_is_snapshot_at_round_end_and_kept_across_rounds(moon_site) -> None:
    # Prepare
    trainer, model = trained_one_round(moon_site)
    end_of_round_0 = numpy_state(model)
    snapshot = trainer.previous_model
    # Execute: a new global model arrives, then round 1 trains.
    trainer.receive(perturbed(end_of_round_0, seed=3))
    after_receive = numpy_state(snapshot)
    trainer.train_round(RoundContext(1, 3))
    # Assert
    for key, value in end_of_round_0.items():  # receiving the global model left the site's snapshot alone
        np.testing.assert_array_equal(after_receive[key], value, err_msg=key)
    assert trainer.previous_model is snapshot  # one copy, refreshed in place
    assert_same_state(snapshot, numpy_state(model))
    assert not np.array_equal(numpy_state(snapshot)["head.weight"], end_of_round_0["head.weight"])


def test_no_gradient_reaches_the_frozen_copies(moon_site) -> None:
    # Prepare
    trainer, model = trained_one_round(moon_site)
    received = perturbed(numpy_state(model), seed=4)
    trainer.receive(received)
    # Execute
    trainer.train_round(RoundContext(1, 3))
    trainer.compute_loss(*moon_site.train.tensors).backward()
    # Assert
    for frozen in (trainer.global_model, trainer.previous_model):
        assert all(not module.training for module in frozen.modules())
        assert all(not p.requires_grad and p.grad is None for p in frozen.parameters())
    assert_same_state(trainer.global_model, received)  # training never moved the global copy
    assert all(p.grad is not None for p in model.parameters())
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in model.parameters()}


def test_outgoing_arrays_are_exactly_the_model_state_dict(moon_site) -> None:
    # Prepare
    trainer, model = trained_one_round(moon_site)
    trainer.receive(perturbed(numpy_state(model), seed=5))
    # Execute
    meta = trainer.train_round(RoundContext(1, 3))
    arrays = trainer.outgoing_arrays()
    # Assert
    assert set(arrays) == set(model.state_dict())
    SPEC.payload.check_outgoing(arrays, meta, list(model.state_dict()), ContractContext(num_classes=3))


def test_one_round_smoke(moon_site) -> None:
    # Prepare
    model = tiny_classifier()
    trainer = make_trainer("moon", model, moon_site)
    before = model.head.weight.detach().clone()
    # Execute
    meta = trainer.train_round(RoundContext(0, 1))
    # Assert
    assert meta["n_samples"] == 10 and math.isfinite(meta["train_loss"])
    assert not torch.equal(model.head.weight.detach(), before)


@pytest.mark.parametrize("bad", [{"mu": -1.0}, {"temperature": 0.0}, {"mu": float("nan")}])
def test_config_rejects_out_of_range_values(bad: dict) -> None:
    with pytest.raises(ConfigError):
        MoonConfig(**bad)


def test_previous_model_survives_a_site_restart(moon_site) -> None:
    """The previous local model is site state: a fresh trainer loading the saved state has it exactly."""
    trainer, model = trained_one_round(moon_site)
    state = trainer.state_dict()
    fresh = make_trainer("moon", tiny_classifier(), moon_site, MoonConfig(mu=0.7))
    assert fresh.previous_model is None
    fresh.load_state(state)
    assert_same_state(fresh.previous_model, numpy_state(trainer.previous_model))
    assert not fresh.previous_model.training and not any(p.requires_grad for p in fresh.previous_model.parameters())
    for group, restored in zip(trainer.optimizer.state_dict()["state"].values(), fresh.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(group[k], restored[k]) for k in group)
