"""FedRep's seams (issue 62; fedrep/ledger.toml), through a site built as a run builds it: the head stage's epochs,
batches and lr, then the body stage's epochs; the body gets no gradient from the head stage, the head none in the
body stage; and the defaults a default job's site reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from medflare.methods.base import RoundContext, round_lr
from medflare.methods.fedrep import client as fedrep_client

from ._run_sites import default_job_site

TRAIN = {"local_epochs": 2, "batch_size": 16, "lr": 0.05, "lr_schedule": "cosine", "min_lr": 0.001}
HEAD_EPOCHS = 3


def _recorded_round(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Round 2 of 3 of a site, recording the head stage (fit_head, its loss's reach) and every body step."""
    site = default_job_site("fedrep", train=TRAIN, method_args={"head_epochs": HEAD_EPOCHS})
    trainer, model = site.trainer, site.model
    body = [p for name, p in model.named_parameters() if not name.startswith("head.")]
    seen: dict[str, Any] = {"site": site, "order": [], "head_steps": [], "body_steps": []}
    real_fit, real_loss, real_compute = fedrep_client.fit_head, trainer._loss, trainer.compute_loss

    def recording_fit(head, features, labels, loss_fn, optimizer, epochs, batch_size):
        seen["order"].append("head")
        seen["fit"] = {"epochs": epochs, "rows": len(labels), "lr": [g["lr"] for g in optimizer.param_groups],
                       "trains": [p for g in optimizer.param_groups for p in g["params"]]}
        return real_fit(head, features, labels, loss_fn, optimizer, epochs, batch_size)

    def recording_head_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = real_loss(logits, labels)
        if seen["order"][-1:] == ["head"]:
            grads = torch.autograd.grad(loss, body, retain_graph=True, allow_unused=True)
            seen["head_steps"].append(all(g is None for g in grads))
        return loss

    def recording_body_step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen["order"].append("body")
        seen["body_steps"].append(not any(p.requires_grad for p in model.head.parameters()))
        return real_compute(images, labels)

    monkeypatch.setattr(fedrep_client, "fit_head", recording_fit)
    monkeypatch.setattr(trainer, "_loss", recording_head_loss)
    monkeypatch.setattr(trainer, "compute_loss", recording_body_step)
    seen["ctx"] = RoundContext(1, 3)
    site.train(site.shared_weights(), seen["ctx"])
    return seen


def test_the_head_trains_head_epochs_over_every_image_at_the_rounds_lr_then_the_body_local_epochs(monkeypatch) -> None:
    """Collins et al. 2021, Algorithm 1: τ_h head epochs (head_epochs) on the received body first, then the body's
    τ epochs (train.local_epochs) under the new head; the head stage trains the head alone, on every labelled
    training image, with batches of train.batch_size at the lr the schedule gives the round."""
    seen = _recorded_round(monkeypatch)
    site = seen["site"]
    fit = seen["fit"]
    assert seen["order"][0] == "head" and set(seen["order"][1:]) == {"body"}
    assert fit["epochs"] == HEAD_EPOCHS and fit["rows"] == int(site.data.class_counts.sum())
    assert {id(p) for p in fit["trains"]} == {id(p) for p in site.model.head.parameters()}
    batches = int(np.ceil(fit["rows"] / TRAIN["batch_size"]))
    assert len(seen["head_steps"]) == HEAD_EPOCHS * batches
    expected_lr = round_lr(site.trainer.train_cfg, seen["ctx"])
    assert expected_lr != pytest.approx(TRAIN["lr"]) and fit["lr"] == [pytest.approx(expected_lr)]
    assert len(seen["body_steps"]) == TRAIN["local_epochs"] * len(site.trainer.train_loader())


def test_the_body_gets_no_gradient_in_the_head_stage_and_the_head_none_in_the_body_stage(monkeypatch) -> None:
    """Collins et al. 2021, Algorithm 1 (the representation fixed while the head updates, and the head fixed while
    the representation updates): every head-stage loss reaches no body parameter; in every body step no head
    parameter is trainable."""
    seen = _recorded_round(monkeypatch)
    assert seen["head_steps"] and all(seen["head_steps"])
    assert seen["body_steps"] and all(seen["body_steps"])


def test_a_default_job_trains_ten_head_epochs_with_fcas_floor_under_fcas_protocol() -> None:
    """Preset: head_epochs 10 (FedRep, Collins et al. 2021: 10 local epochs for the head), balanced softmax's floor
    1e-9 (FCA's, spec §1.1; FCA runs FedRep with BSM, spec §6(e)5), and FCA's protocol (§4.2): each site's test
    split follows its training class mix, read off the site's own test labels."""
    site = default_job_site("fedrep", partition="dirichlet:0.05")
    assert (site.trainer.cfg.head_epochs, site.trainer.cfg.eps) == (10, 1e-9)
    test_counts = np.bincount(site.data.test.labels, minlength=site.data.num_classes)
    assert (site.data.class_counts == 0).any() and np.all(test_counts[site.data.class_counts == 0] == 0)
