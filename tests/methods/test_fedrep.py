"""FedRep: the head phase then the body phase of one round against a hand-written update; the head stays home."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from medflare.evaluation import SPECIALIZATION
from medflare.methods.base import RoundContext
from medflare.methods.fedrep import FedRepConfig
from medflare.ops import model_params
from medflare.plan import build_global_model
from medflare.registry import get_method

from ._generalization import check_generalization_by_hand
from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

LABELS = [0, 0, 0, 1, 0, 2, 0, 1, 0, 0, -1, 0]


def _bsm(logits: torch.Tensor, labels: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    prior = torch.log(torch.tensor(counts, dtype=torch.float64) / counts.sum() + 1e-9)
    return F.cross_entropy(logits + prior, labels)


def test_one_round_is_a_head_step_then_a_body_step_with_the_new_head() -> None:
    site = make_site(n=12, labels=LABELS)
    model, reference = tiny_classifier(), tiny_classifier()
    trainer = make_trainer("fedrep", model, site, FedRepConfig(head_epochs=1), max_steps=1)
    trainer.train_round(RoundContext(0, 1))

    x, y = site.train.tensors
    keep = y >= 0
    linear = reference.backbone[0]
    features = torch.tanh(x[keep] @ linear.weight.T + linear.bias)
    w, b = reference.head.weight, reference.head.bias
    gw, gb = torch.autograd.grad(_bsm(features.detach() @ w.T + b, y[keep], site.class_counts), [w, b])
    new_w, new_b = (w - 0.1 * gw).detach(), (b - 0.1 * gb).detach()
    assert torch.allclose(model.head.weight, new_w, atol=1e-12) and torch.allclose(model.head.bias, new_b, atol=1e-12)
    body = list(linear.parameters())
    grads = torch.autograd.grad(_bsm(features @ new_w.T + new_b, y[keep], site.class_counts), body)
    for after, before, grad in zip(model.backbone[0].parameters(), body, grads):
        assert torch.allclose(after, before - 0.1 * grad, atol=1e-12)


def test_the_head_never_travels_and_survives_a_state_round_trip() -> None:
    site = make_site(n=12, labels=LABELS)
    trainer = make_trainer("fedrep", tiny_classifier(), site, FedRepConfig(head_epochs=2), max_steps=2)
    trainer.train_round(RoundContext(0, 2))
    sent = trainer.outgoing_arrays()
    assert sent and not any(k.startswith("head.") for k in sent)
    head = model_params(trainer.model, keep=lambda k: k.startswith("head."))
    trainer.receive({k: np.zeros_like(v) for k, v in model_params(tiny_classifier(seed=3)).items()})
    assert all(np.array_equal(model_params(trainer.model)[k], v) for k, v in head.items())
    state = trainer.state_dict()
    fresh = make_trainer("fedrep", tiny_classifier(seed=4), site, FedRepConfig(head_epochs=2))
    fresh.load_state(state)
    assert all(np.array_equal(model_params(fresh.model)[k], v) for k, v in head.items())
    assert get_method("fedrep").payload.is_private("head.weight")


def test_specialization_is_the_sites_own_model() -> None:
    site = make_site(n=12, labels=LABELS)
    trainer = make_trainer("fedrep", tiny_classifier(), site, FedRepConfig(head_epochs=1), max_steps=1)
    trainer.train_round(RoundContext(0, 1))
    own = trainer.extra_evaluations("test")[SPECIALIZATION]
    assert np.array_equal(own.confusion, trainer.evaluate("test").confusion)


def test_the_head_phase_runs_head_epochs_passes_on_the_received_body_first() -> None:
    site = make_site(n=12, labels=LABELS)
    model, reference = tiny_classifier(), tiny_classifier()
    trainer = make_trainer("fedrep", model, site, FedRepConfig(head_epochs=3), max_steps=1)
    trainer.train_round(RoundContext(0, 1))

    x, y = site.train.tensors
    keep = y >= 0
    features = torch.tanh(x[keep] @ reference.backbone[0].weight.T + reference.backbone[0].bias).detach()
    w, b = reference.head.weight.detach(), reference.head.bias.detach()
    for _ in range(3):  # three full-batch epochs on the frozen body's features, then the body step leaves the head
        w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
        gw, gb = torch.autograd.grad(_bsm(features @ w.T + b, y[keep], site.class_counts), [w, b])
        w, b = (w - 0.1 * gw).detach(), (b - 0.1 * gb).detach()
    assert torch.allclose(model.head.weight, w, atol=1e-12) and torch.allclose(model.head.bias, b, atol=1e-12)


def test_the_default_head_phase_is_the_papers_ten_epochs() -> None:
    assert FedRepConfig().head_epochs == 10


def test_the_server_neither_holds_nor_broadcasts_a_head() -> None:
    spec = get_method("fedrep")
    start = {k: v.numpy() for k, v in build_global_model("fedrep", "cnn", 3, 1, 28).state_dict().items()}
    assert start and not any(k.startswith("head.") for k in start)
    rule = spec.server_rule_cls(FedRepConfig(), 2, spec.payload)
    assert set(rule.phase_arrays("train", RoundContext(0, 2), start, {})) == set(start)


def test_the_head_phase_runs_every_round_not_only_the_first() -> None:
    site = make_site(n=12, labels=LABELS)
    trainer = make_trainer("fedrep", tiny_classifier(), site, FedRepConfig(head_epochs=1), max_steps=1)
    trainer.train_round(RoundContext(0, 2))
    after_first = trainer.model.head.weight.detach().clone()
    trainer.train_round(RoundContext(1, 2))
    assert not torch.allclose(trainer.model.head.weight, after_first)  # the body step alone never moves the head


def test_generalization_is_each_sites_own_model_on_the_pooled_test_set_by_hand() -> None:
    """FCA reports FedRep's generalization (Tables 4-5): each site's body and personal head on the pooled test set,
    averaged over sites; checked against a forward pass of each site's model over both sites' test slices."""
    check_generalization_by_hand("fedrep")
