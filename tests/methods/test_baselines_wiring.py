"""The baselines' trainer wiring (each method's ledger.toml): what each trainer hands its loss, which layers MOON's
contrastive term reaches, and every baseline's defaults against the spec (§1.1, §1.4, §1.10) and its paper."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest
import torch

from medflare.losses import restricted_logits
from medflare.methods.base import RoundContext
from medflare.registry import get_method

from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

LABELS = [0, 0, 2, 1, 0, -1, 0, 1, 0, 0, -1, 0]  # a skewed site with two unlabelled rows; class counts 7, 2, 1


def _counts(site: Any) -> list[float]:
    return [float(c) for c in site.class_counts]


# (method, the client module, the loss function it calls, method args, the arguments after (logits, labels) the
# loss must receive as a function of the site, the keyword arguments it must receive, how the logits it receives
# follow from the model's logits of the labelled rows)
LOSS_CASES = [
    ("bsm-fl", "bsm_fl", "balanced_softmax_loss", {"eps": 1e-6}, lambda site: [_counts(site)], {"eps": 1e-6}, None),
    ("fedlc", "fedlc", "logit_calibrated_ce", {"tau": 0.3}, lambda site: [_counts(site)], {"tau": 0.3}, None),
    ("fedrs", "fedrs", "balanced_softmax_loss", {"alpha": 0.3, "restriction": "hard", "eps": 1e-6},
     lambda site: [_counts(site)], {"eps": 1e-6},
     lambda logits, site: restricted_logits(logits, torch.tensor(_counts(site)), 0.3, "hard")),
    ("local-only", "local_only", "balanced_softmax_loss", {"loss": "bsm", "eps": 1e-6}, lambda site: [_counts(site)],
     {"eps": 1e-6}, None),
    ("local-only", "local_only", "symmetric_cross_entropy", {"loss": "sce", "sce_alpha": 0.3, "sce_beta": 0.7},
     lambda site: [0.3, 0.7], {}, None),
    ("fedbabu", "fedbabu", "balanced_softmax_loss", {"eps": 1e-6}, lambda site: [_counts(site)], {"eps": 1e-6}, None),
]


@pytest.mark.parametrize("method, module, function, args, rest, kwargs, transform", LOSS_CASES,
                         ids=[f"{case[0]}-{case[2]}" for case in LOSS_CASES])
def test_the_trainer_hands_the_loss_the_models_logits_of_the_labelled_rows_and_the_sites_own_counts(
    method: str, module: str, function: str, args: dict, rest: Any, kwargs: dict, transform: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One step through the trainer with non-default settings: the loss receives the model's logits of the batch's
    labelled rows (after the method's own logit transform), those rows' labels, the site's own class counts, and
    the job's settings; nothing is left at its default."""
    site = make_site(n=12, labels=LABELS)
    spec = get_method(method)
    model = tiny_classifier()
    trainer = make_trainer(method, model, site, spec.config_cls(**args), max_steps=1)
    client = importlib.import_module(f"medflare.methods.{module}.client")
    batches, calls = [], []
    compute_loss, loss_fn = trainer.compute_loss, getattr(client, function)

    def recording_batch(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batches.append((images.clone(), labels.clone()))
        return compute_loss(images, labels)

    def recording_loss(logits: torch.Tensor, targets: torch.Tensor, *more: Any, **named: Any) -> torch.Tensor:
        images, labels = batches[-1]
        with torch.no_grad():
            expected = model(images[labels >= 0])
            expected = transform(expected, site) if transform else expected
        calls.append((logits.detach().clone(), expected, targets.clone(), more, named))
        return loss_fn(logits, targets, *more, **named)

    monkeypatch.setattr(trainer, "compute_loss", recording_batch)
    monkeypatch.setattr(client, function, recording_loss)
    trainer.train_round(RoundContext(0, 1))
    [(_, labels)], [(logits, expected, targets, more, named)] = batches, calls
    assert logits.shape == (10, 3)  # the 10 labelled rows
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    assert torch.equal(targets, labels[labels >= 0])
    assert [torch.as_tensor(m).tolist() if isinstance(m, torch.Tensor) else m for m in more] == rest(site)
    assert named == kwargs


def test_moons_contrastive_term_reaches_every_layer_of_the_extractor_and_no_frozen_copy() -> None:
    """MOON (Li, He and Song 2021, Eq. 3): ℓ_con is on the representation z, so on a batch without labels (CE 0)
    its gradient reaches every layer of the feature extractor and not the classifier head."""
    site = make_site(n=12, labels=LABELS)
    model = tiny_classifier()
    trainer = make_trainer("moon", model, site, get_method("moon").config_cls(mu=1.0))
    trainer.train_round(RoundContext(0, 3))
    trainer.receive({k: (v + 0.05).numpy() for k, v in model.state_dict().items()})
    trainer.on_round_start(RoundContext(1, 3))
    with torch.no_grad():
        model.backbone[0].weight.add_(0.05)  # the model moves off the received one, as during a round
    images, labels = site.train.tensors
    model.zero_grad(set_to_none=True)
    trainer.compute_loss(images, torch.full_like(labels, -1)).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(grads[k] is not None and bool(grads[k].abs().sum() > 0) for k in ("backbone.0.weight", "backbone.0.bias"))
    assert all(grads[k] is None or not bool(grads[k].abs().sum() > 0) for k in ("head.weight", "head.bias"))
    frozen = [*trainer.global_model.parameters(), *trainer.previous_model.parameters()]
    assert all(p.grad is None and not p.requires_grad for p in frozen)


# method -> its defaults (spec §1.1, §1.4, §1.10; the papers' values where they give one)
DEFAULTS = {
    "bsm-fl": {"eps": 1e-12},  # spec §1.1: Fed-MAS's BlSoftmaxLoss floor
    "fedlc": {"tau": 0.5},  # spec §1.10: "LCC" τ = 0.5
    "fedprox": {"mu": 0.01},  # README: 0.01, from the Fed-MAS appendix sweep {0.1, 0.01, 0.001}
    "moon": {"mu": 1.0, "temperature": 0.5},  # spec §1.10: temperature 0.5; Fed-MAS Table 8: μ = 1 best
    "ldam-drw": {"max_margin": 0.5, "scale": 30.0, "drw_beta": 0.9999, "drw_start_fraction": 0.8},  # spec §1.10
    "fedrs": {"alpha": 0.5, "restriction": "soft", "loss": "bsm", "eps": 1e-9},  # FCA's baselines use BSM (§6(e)5)
    "fedrep": {"head_epochs": 10, "eps": 1e-9},  # FedRep paper: 10 head epochs; FCA's BSM floor
    "fedbabu": {"finetune_epochs": 5, "eps": 1e-9},  # README: 5 head fine-tuning epochs; FCA's BSM floor
    "local-only": {"loss": "ce", "eps": 1e-9, "sce_alpha": 0.1, "sce_beta": 1.0},  # spec §1.4: α 0.1, β 1.0
    "fedmd": {"loss": "ce", "weighting": "mean", "include_self": True, "kl_optimizer": "persistent"},
    "fedavg": {},  # McMahan et al. 2017: no option of its own; it trains on the comparison's shared TrainConfig
    "fedavg-masked": {},  # FPSL's FedAvg*: FedAvg with a masked classifier average, no option of its own
}
TRAIN_DEFAULTS = {"fedmd": {"optimizer": "adam", "lr": 1e-3, "batch_size": 16, "fresh_optimizer": "never"}}


@pytest.mark.parametrize("method", sorted(DEFAULTS))
def test_each_baselines_defaults_are_its_papers_and_the_specs(method: str) -> None:
    spec = get_method(method)
    cfg = spec.config_cls()
    assert DEFAULTS[method] or not dataclasses.fields(cfg)  # an option-free baseline really has none
    assert {name: getattr(cfg, name) for name in DEFAULTS[method]} == DEFAULTS[method]
    assert dict(spec.train_defaults) == TRAIN_DEFAULTS.get(method, {})
