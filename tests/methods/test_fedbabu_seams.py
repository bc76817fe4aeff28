"""FedBABU's seams (issue 62; fedbabu/ledger.toml), through a site built as a run builds it: which epochs and lr
each stage reads (the body's federated training, the head's fine-tune before scoring), that the head gets no
gradient while the body trains, and the defaults a default job's site reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from medflare.methods.base import RoundContext, round_lr
from medflare.methods.fedbabu import client as fedbabu_client

from ._run_sites import default_job_site

TRAIN = {"local_epochs": 2, "batch_size": 16, "lr": 0.05, "lr_schedule": "cosine", "min_lr": 0.001}
FINETUNE_EPOCHS = 3


def _recorded_round(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """One scored round (round 2 of 3) of a site, recording every body step and every head fine-tune."""
    site = default_job_site("fedbabu", train=TRAIN, method_args={"finetune_epochs": FINETUNE_EPOCHS})
    trainer, model = site.trainer, site.model
    seen: dict[str, Any] = {"body": [], "finetune": [], "site": site}
    real_fit, real_loss = fedbabu_client.fit_head, trainer.compute_loss

    def recording_fit(head, features, labels, loss_fn, optimizer, epochs, batch_size):
        seen["finetune"].append({"epochs": epochs, "batch_size": batch_size, "rows": len(labels),
                                 "lr": [group["lr"] for group in optimizer.param_groups],
                                 "trains": [p for group in optimizer.param_groups for p in group["params"]],
                                 "head": head, "features_grad": features.requires_grad})
        return real_fit(head, features, labels, loss_fn, optimizer, epochs, batch_size)

    def recording_loss(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = real_loss(images, labels)
        trainable = [p for p in model.head.parameters() if p.requires_grad]
        head_grads = [g for g in torch.autograd.grad(loss, trainable, retain_graph=True, allow_unused=True)
                      if g is not None and bool(g.abs().sum() > 0)] if trainable else []
        seen["body"].append({"head_trainable": [p.requires_grad for p in model.head.parameters()],
                             "head_grads": head_grads})
        return loss

    monkeypatch.setattr(fedbabu_client, "fit_head", recording_fit)
    monkeypatch.setattr(trainer, "compute_loss", recording_loss)
    seen["head_before"] = {k: v.clone() for k, v in model.head.state_dict().items()}
    seen["ctx"] = RoundContext(1, 3)
    site.train(site.shared_weights(), seen["ctx"])  # scores the received model (fine-tuned head), then trains
    site.validate(site.shared_weights(), RoundContext(2, 3))  # the final validation: fine-tunes the trained body
    return seen


def test_the_body_trains_local_epochs_and_the_head_fine_tunes_finetune_epochs_at_the_rounds_lr(monkeypatch) -> None:
    """Oh et al. 2022, §3 and Algorithm 1: during FL only the body trains, τ local epochs (train.local_epochs) per
    round; before a model is scored, a copy of the head is fine-tuned τ_f epochs (finetune_epochs, not the local
    epochs) on the site's training features, once per model, the trained one at the lr of the round that trained it."""
    seen = _recorded_round(monkeypatch)
    site = seen["site"]
    batches = int(np.ceil(len(site.data.train) / TRAIN["batch_size"]))
    labelled_batches = len(site.trainer.train_loader())
    assert len(seen["body"]) == TRAIN["local_epochs"] * labelled_batches and batches >= labelled_batches > 1
    assert len(seen["finetune"]) == 2  # one per scored model: the received one, then the trained one
    expected_lr = round_lr(site.trainer.train_cfg, seen["ctx"])
    assert expected_lr != pytest.approx(TRAIN["lr"])  # the schedule has moved off the base lr by round 2
    for fit in seen["finetune"]:
        assert fit["epochs"] == FINETUNE_EPOCHS and fit["batch_size"] == TRAIN["batch_size"]
        assert fit["rows"] == int(site.data.class_counts.sum())
    # the trained model's fine-tune reads the lr of the round that trained it (a fresh site's first scoring has no
    # trained round yet: see the method card)
    assert seen["finetune"][-1]["lr"] == [pytest.approx(expected_lr)]


def test_a_restarted_site_fine_tunes_at_the_lr_of_the_round_that_trained_its_body(monkeypatch, tmp_path) -> None:
    """The fine-tune reads the lr of the round that trained the body, also in a site restarted after that round (it
    kept the round in its state; it fine-tuned at the schedule's end, min_lr, before issue 62's fix)."""
    options = {"train": TRAIN, "method_args": {"finetune_epochs": 1}, "local_dir": tmp_path}
    site = default_job_site("fedbabu", **options)
    ctx = RoundContext(1, 3)
    site.train(site.shared_weights(), ctx)
    site.close()  # the state write is on disk
    restarted = default_job_site("fedbabu", **options)
    rates: list[list[float]] = []
    real_fit = fedbabu_client.fit_head

    def recording_fit(head, features, labels, loss_fn, optimizer, epochs, batch_size):
        rates.append([group["lr"] for group in optimizer.param_groups])
        return real_fit(head, features, labels, loss_fn, optimizer, epochs, batch_size)

    monkeypatch.setattr(fedbabu_client, "fit_head", recording_fit)
    restarted.validate(restarted.shared_weights(), RoundContext(2, 3))
    expected = round_lr(restarted.trainer.train_cfg, ctx)
    assert expected != pytest.approx(TRAIN["min_lr"]) and rates == [[pytest.approx(expected)]]


def test_the_head_gets_no_gradient_while_the_body_trains_and_its_fine_tune_is_a_copy(monkeypatch) -> None:
    """Oh et al. 2022, §3 (the head stays at its random initialisation during FL): in every body step no head
    parameter is trainable or receives a gradient, so the head the site sends back is bit for bit the one it got;
    the fine-tune trains only a copy's parameters on features cut from the body's graph."""
    seen = _recorded_round(monkeypatch)
    model = seen["site"].model
    assert seen["body"] and all(not any(step["head_trainable"]) and not step["head_grads"] for step in seen["body"])
    assert all(torch.equal(v, seen["head_before"][k]) for k, v in model.head.state_dict().items())
    for fit in seen["finetune"]:
        own = {id(p) for p in fit["head"].parameters()}
        assert fit["head"] is not model.head and {id(p) for p in fit["trains"]} == own
        assert not fit["features_grad"]


def test_a_default_job_fine_tunes_five_epochs_with_fcas_floor_under_fcas_protocol() -> None:
    """Preset: finetune_epochs 5 (the method card; FedBABU's fine-tuning before evaluation), balanced softmax's
    floor eps 1e-9 (FCA's, spec §1.1, FCA compares FedBABU with BSM: spec §6(e)5), and FCA's protocol: each
    site's test split follows its training class mix (FCA §4.2), read off the site's own test labels."""
    site = default_job_site("fedbabu", partition="dirichlet:0.05")
    assert (site.trainer.cfg.finetune_epochs, site.trainer.cfg.eps) == (5, 1e-9)
    test_counts = np.bincount(site.data.test.labels, minlength=site.data.num_classes)
    assert (site.data.class_counts == 0).any() and np.all(test_counts[site.data.class_counts == 0] == 0)
