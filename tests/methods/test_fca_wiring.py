"""FCA trainer wiring (methods/fca/ledger.toml): what the trainer hands FCA's loss, which layers each term reaches,
the state a site keeps over rounds (its personal head and Adam moments stay, the shared weights are the server's),
and the paper's training defaults (spec §6(a)-(c))."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import medflare.methods.fca.client as fca_client
from medflare.methods.base import RoundContext, TrainConfig
from medflare.methods.fca import FcaConfig
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec, resolve_train_config
from medflare.site_runtime import SiteRuntime

from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

LABELS = [0, 0, 2, 1, 0, -1, 0, 1, 0, 0, -1, 0]  # two unlabelled rows
PERSONAL = ("personal_head.weight", "personal_head.bias")


def _fca_net(seed: int = 0) -> Any:
    from medflare.methods.fca.model import FcaNet

    torch.manual_seed(seed + 100)
    return FcaNet(tiny_classifier(seed=seed)).double()


# ----- (a) what the trainer hands the loss ----------------------------------------------------------------------
def test_the_trainer_hands_fca_loss_both_heads_on_the_labelled_rows_the_sites_counts_and_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One step through the trainer with non-default settings: fca_loss receives the federated and the personal
    head's logits of one pass through the shared extractor, on the batch's labelled rows only, those rows' labels,
    the site's own class counts (π_k), and every FCA setting of the job."""
    site = make_site(n=12, labels=LABELS)
    cfg = FcaConfig(lambda_fed=0.5, lambda_personal=2.0, consistency_weight=0.7, consistency="repo", temperature=2.0,
                    eps=1e-6)
    net = _fca_net()
    trainer = make_trainer("fca", net, site, cfg, max_steps=1)
    batches, calls = [], []
    compute_loss, fca_loss = trainer.compute_loss, fca_client.fca_loss

    def recording_batch(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batches.append((images.clone(), labels.clone()))
        return compute_loss(images, labels)

    def recording_loss(fed_logits, personal_logits, targets, class_counts, **kwargs: Any) -> torch.Tensor:
        images, labels = batches[-1]
        with torch.no_grad():
            features = net.backbone(images[labels >= 0])
            expected = (net.head(features), net.personal_head(features))
        calls.append((fed_logits.detach().clone(), personal_logits.detach().clone(), expected, targets.clone(),
                      torch.as_tensor(class_counts).clone(), kwargs))
        return fca_loss(fed_logits, personal_logits, targets, class_counts, **kwargs)

    monkeypatch.setattr(trainer, "compute_loss", recording_batch)
    monkeypatch.setattr(fca_client, "fca_loss", recording_loss)
    trainer.train_round(RoundContext(0, 1))
    [(images, labels)], [(fed, personal, (fed_by_hand, personal_by_hand), targets, counts, kwargs)] = batches, calls
    assert len(images) == len(LABELS) and fed.shape == personal.shape == (10, 3)  # the 10 labelled rows
    torch.testing.assert_close(fed, fed_by_hand, rtol=0, atol=1e-12)
    torch.testing.assert_close(personal, personal_by_hand, rtol=0, atol=1e-12)
    assert torch.equal(targets, labels[labels >= 0])
    assert counts.tolist() == np.bincount([y for y in LABELS if y >= 0], minlength=3).tolist()
    assert kwargs == {"lambda_fed": 0.5, "lambda_personal": 2.0, "consistency_weight": 0.7, "consistency": "repo",
                      "temperature": 2.0, "eps": 1e-6}


# ----- (c) which layers each term reaches -----------------------------------------------------------------------
def _gradients(cfg: FcaConfig) -> dict[str, torch.Tensor | None]:
    site = make_site(n=12, labels=LABELS)
    trainer = make_trainer("fca", _fca_net(), site, cfg)
    images, labels = site.train.tensors
    trainer.compute_loss(images, labels).backward()
    return {name: p.grad for name, p in trainer.model.named_parameters()}


def _learns(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.abs().sum() > 0)


def test_the_consistency_term_reaches_the_extractor_and_the_federated_head_and_every_term_some_layer() -> None:
    """Spec §6(a) client step 2: L_con's gradient reaches the federated head and the shared extractor, never the
    personal head; with every term on, every layer of the network learns (the personal head by its own BSM)."""
    anchor_only = _gradients(FcaConfig(lambda_fed=0.0, lambda_personal=0.0))
    assert all(_learns(anchor_only[k]) for k in ("backbone.0.weight", "backbone.0.bias", "head.weight", "head.bias"))
    assert not any(_learns(anchor_only[k]) for k in PERSONAL)
    everything = _gradients(FcaConfig())
    assert all(_learns(grad) for grad in everything.values()), [k for k, g in everything.items() if not _learns(g)]
    personal_only = _gradients(FcaConfig(lambda_fed=0.0, consistency_weight=0.0))
    assert all(_learns(personal_only[k]) for k in (*PERSONAL, "backbone.0.weight"))
    assert not _learns(personal_only["head.weight"])  # the federated head's BSM and the anchor are off


# ----- (b) state over rounds on one site ------------------------------------------------------------------------
TASK = TaskSpec(num_classes=3, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=80,classes=3,imbalance=3", "num_sites": 2, "partition": "iid"}


def _site() -> SiteRuntime:
    settings = SiteSettings(spec=get_method("fca"), task=TASK, data=DATA, model="cnn", train={"max_steps": 2, "batch_size": 8},
                            evaluation="off")
    return SiteRuntime(settings, "site-1", 0, log=lambda message: None)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_over_rounds_the_personal_head_and_adam_moments_stay_and_the_shared_weights_are_the_servers() -> None:
    """Three rounds on one site (rounds 0, 60, 70 of 80): every round starts from the server's shared weights and
    the personal head the site's previous round left (never reinitialised, never sent); the same Adam optimizer
    keeps its moments over the rounds (spec §0); its lr is 1e-3, then x0.1 from round 60 and again from round 70."""
    site = _site()
    trainer = site.trainer
    starts: list[dict[str, torch.Tensor]] = []
    on_round_start = trainer.on_round_start

    def recording(ctx: RoundContext) -> None:  # the weights the round's first step starts from
        on_round_start(ctx)
        starts.append(_state(trainer.model))

    trainer.on_round_start = recording
    server = {k: v.detach().numpy().copy() for k, v in site.model.state_dict().items() if not k.startswith("personal_")}
    ends, optimizer = [], None
    for index, round_ in enumerate((0, 60, 70)):
        sent, meta = site.train(server, RoundContext(round_, 80))
        assert not any(key.startswith("personal_head.") for key in sent) and "head.weight" in sent
        start, end = starts[index], _state(trainer.model)
        for key, value in server.items():
            assert np.array_equal(start[key].numpy(), value), (round_, key)  # the server's weights were loaded
        if ends:
            assert all(torch.equal(start[k], ends[-1][k]) for k in PERSONAL)  # the site's own head carried on
        assert not all(torch.equal(start[k], end[k]) for k in PERSONAL)  # and it trains every round
        optimizer = optimizer or trainer.optimizer
        assert trainer.optimizer is optimizer
        assert {int(s["step"]) for s in optimizer.state.values()} == {2 * (index + 1)}
        assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.1**index)
        ends.append(end)
        server = {k: (v - 0.01).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in server.items()}


# ----- defaults: the paper and the authors' notebook ------------------------------------------------------------
def test_fca_defaults_are_the_papers_training_recipe() -> None:
    """Spec §6(c): Adam lr 1e-3, weight decay 5e-4, batch 64, one local epoch, lr x0.1 at rounds 60 and 70 of 80;
    λ₁ = 1, λ₂ = 3, consistency weight 1, KL at temperature 1 (the paper's, not the notebook's variant)."""
    spec = get_method("fca")
    train = resolve_train_config(spec, {})
    assert (train.optimizer, train.lr, train.weight_decay, train.batch_size, train.local_epochs) == (
        "adam", 1e-3, 5e-4, 64, 1)
    assert (train.lr_schedule, tuple(train.milestones), train.gamma, train.fresh_optimizer) == (
        "multistep", (60, 70), 0.1, "never")
    cfg = FcaConfig()
    assert (cfg.lambda_fed, cfg.lambda_personal, cfg.consistency_weight) == (1.0, 3.0, 1.0)
    assert (cfg.consistency, cfg.temperature, cfg.eps) == ("kl", 1.0, 1e-9)
    preset = spec.presets["paper"].overrides
    assert preset["rounds"] == 80 and preset["clients"] == 6 and preset["model"] == "efficientnet_b0"
    assert isinstance(train, TrainConfig)
