"""FedBABU: the head stays frozen at the broadcast initialisation; a fine-tuned copy scores the specialization."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from medflare.evaluation import SPECIALIZATION
from medflare.methods import fedbabu
from medflare.methods.base import RoundContext
from medflare.methods.fedbabu import FedBabuConfig, build_fedbabu_model
from medflare.ops import model_params

from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

LABELS = [0, 0, 0, 1, 0, 2, 0, 1, 0, 0, -1, 0]


def frozen_head_classifier(seed: int = 0):
    model = tiny_classifier(seed=seed)
    model.head.requires_grad_(False)
    return model


def test_builder_freezes_the_head() -> None:
    model = build_fedbabu_model("cnn", 3, 1, 28, None, FedBabuConfig())
    assert not any(p.requires_grad for p in model.head.parameters())
    assert all(p.requires_grad for p in model.backbone.parameters())


def test_training_moves_the_body_and_never_the_head() -> None:
    site = make_site(n=12, labels=LABELS)
    trainer = make_trainer("fedbabu", frozen_head_classifier(), site, max_steps=3)
    before = model_params(trainer.model)
    trainer.train_round(RoundContext(0, 1))
    after = model_params(trainer.model)
    assert all(np.array_equal(after[k], before[k]) for k in ("head.weight", "head.bias"))
    assert not np.array_equal(after["backbone.0.weight"], before["backbone.0.weight"])
    assert {"head.weight", "head.bias"} <= set(trainer.outgoing_arrays())  # shared, identical at every site


def test_specialization_uses_a_head_fine_tuned_by_hand(monkeypatch) -> None:
    site = make_site(n=12, labels=LABELS)
    model = frozen_head_classifier()
    trainer = make_trainer("fedbabu", model, site, FedBabuConfig(finetune_epochs=1))
    fits = []
    monkeypatch.setattr(fedbabu.client, "fit_head", lambda *a, **k: fits.append(1) or real_fit(*a, **k))
    stats = {split: trainer.extra_evaluations(split)[SPECIALIZATION] for split in ("val", "test")}
    assert len(fits) == 1  # one fine-tune serves val and test

    x, y = site.train.tensors
    keep = y >= 0
    features = torch.tanh(x @ model.backbone[0].weight.T + model.backbone[0].bias).detach()
    w, b = model.head.weight.clone().requires_grad_(), model.head.bias.clone().requires_grad_()
    prior = torch.log(torch.tensor(site.class_counts, dtype=torch.float64) / site.class_counts.sum() + 1e-9)
    gw, gb = torch.autograd.grad(F.cross_entropy(features[keep] @ w.T + b + prior, y[keep]), [w, b])
    predicted = (features[keep] @ (w - 0.1 * gw).T + (b - 0.1 * gb)).argmax(dim=1)
    expected = np.zeros((3, 3), dtype=np.int64)
    np.add.at(expected, (y[keep].numpy(), predicted.numpy()), 1)
    assert np.array_equal(stats["test"].confusion, expected)
    assert not model.head.weight.requires_grad  # the model's own head is untouched
    trainer.train_round(RoundContext(0, 1))
    trainer.extra_evaluations("val")
    assert len(fits) == 2  # a new model gets a new fine-tune


real_fit = fedbabu.client.fit_head


def test_one_step_trains_the_body_by_balanced_softmax_through_the_frozen_head() -> None:
    site = make_site(n=12, labels=LABELS)
    model, reference = frozen_head_classifier(), frozen_head_classifier()
    trainer = make_trainer("fedbabu", model, site, max_steps=1)
    trainer.train_round(RoundContext(0, 1))

    x, y = site.train.tensors
    keep = y >= 0
    body = list(reference.backbone[0].parameters())
    features = torch.tanh(x[keep] @ body[0].T + body[1])
    prior = torch.log(torch.tensor(site.class_counts, dtype=torch.float64) / site.class_counts.sum() + 1e-9)
    loss = F.cross_entropy(features @ reference.head.weight.T + reference.head.bias + prior, y[keep])
    for after, before, grad in zip(model.backbone[0].parameters(), body, torch.autograd.grad(loss, body)):
        assert torch.allclose(after, before - 0.1 * grad, atol=1e-12)


def test_the_fine_tuned_head_is_a_copy_that_never_reaches_the_model_or_the_wire() -> None:
    site = make_site(n=12, labels=LABELS)
    trainer = make_trainer("fedbabu", frozen_head_classifier(), site, FedBabuConfig(finetune_epochs=3))
    sent_before = trainer.outgoing_arrays()
    tuned = trainer.extra_evaluations("test")[SPECIALIZATION]
    assert tuned.to_dict() != trainer.evaluate("test").to_dict()  # the fine-tuned head scores differently
    sent_after = trainer.outgoing_arrays()
    assert all(np.array_equal(sent_after[k], sent_before[k]) for k in ("head.weight", "head.bias"))
    trainer.train_round(RoundContext(0, 1))
    assert all(np.array_equal(trainer.outgoing_arrays()[k], sent_before[k]) for k in ("head.weight", "head.bias"))
