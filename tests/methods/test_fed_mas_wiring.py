"""Fed-MAS through its own training loop (issue 51, item 3): which tensors each loss term gets from the trainer,
which statistics are this round's only, and which layers the distillation and auxiliary terms reach."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from medflare.losses import balanced_softmax_loss
from medflare.methods.base import RoundContext
from medflare.methods.fed_mas import client as fed_mas_client
from medflare.methods.fed_mas.prior import IMAGENET_MEAN, IMAGENET_STD
from medflare.methods.fed_mas.rescue import distillation_distance, rescue_factor

from .test_fed_mas import W_IMAGES, W_LABELS, hand_global_divergence, received_global_model, tiny_fedmas_trainer

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # TorchScript priors are supported

SITE_COUNTS = torch.tensor([3.0, 0.0, 3.0])  # the tiny site's class counts (classes 0 and 2, three images each)


def teacher_by_hand(encoder: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The linear prior's features of ``images``: grey to RGB, back to [0, 1], ImageNet-normalised."""
    pixels = images.double().repeat(1, 3, 1, 1) * 0.5 + 0.5
    pixels = (pixels - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    linear = encoder[1]
    return pixels.flatten(1) @ linear.weight.detach().double().T + linear.bias.detach().double()


def labels_of(images: torch.Tensor) -> torch.Tensor:
    """The site's labels of a batch of its training images (each image is one row of W_IMAGES)."""
    rows = [int(torch.nonzero((W_IMAGES == image).flatten(1).all(dim=1))[0]) for image in images]
    return W_LABELS[rows]


def other_global_model(received: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """A later round's global model: the same keys, other weights (BatchNorm variances kept positive)."""
    rng = np.random.default_rng(seed)
    moved = {}
    for key, value in received.items():
        if value.dtype.kind != "f" or key.endswith("running_var"):
            moved[key] = value.copy()
        else:
            moved[key] = (value + rng.normal(0.0, 0.5, value.shape)).astype(value.dtype)
    return moved


Forward = tuple[torch.Tensor, tuple[torch.Tensor, ...]]
Distance = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def spy_training_steps(trainer, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Forward], list[Distance]]:
    """What the trainer computes with gradients on, i.e. in its loss: (images, (logits, aux logits, projected))
    of every forward and (student, teacher, L_f) of every distance, in step order."""
    forwards: list[Forward] = []
    distances: list[Distance] = []
    forward_train = trainer.model.forward_train

    def spy_forward(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        outputs = forward_train(images)
        if torch.is_grad_enabled():
            forwards.append((images.clone(), tuple(t.detach().clone() for t in outputs)))
        return outputs

    def spy_distance(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        distance = distillation_distance(student, teacher)
        if torch.is_grad_enabled():
            distances.append((student.detach().clone(), teacher.detach().clone(), distance.detach().clone()))
        return distance

    monkeypatch.setattr(trainer.model, "forward_train", spy_forward)
    monkeypatch.setattr(fed_mas_client, "distillation_distance", spy_distance)
    return forwards, distances


def class_sums(labels: torch.Tensor, values: torch.Tensor) -> np.ndarray:
    return np.bincount(labels.numpy(), weights=values.double().numpy(), minlength=3)


# ----- (a) what each loss term receives from the training loop --------------------------------------------------
def test_each_loss_term_gets_this_batchs_outputs_and_labels_and_the_sites_class_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spec §2(a) step 3 through train_round, in batches of 2 (the class mix of a batch is not the site's):
    BSM on the main head and BSM on the auxiliary head of the same forward, both with the site's class counts
    π_c; L_f between the projector's output and the frozen prior's feature of the same images; ŵ accumulates
    exactly those L_f."""
    trainer, encoder = tiny_fedmas_trainer(tmp_path)
    trainer.job_train_cfg = dataclasses.replace(trainer.job_train_cfg, batch_size=2)
    trainer.receive(received_global_model(trainer))
    bsm_calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def spy_bsm(logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor, **kwargs) -> torch.Tensor:
        bsm_calls.append((logits.detach().clone(), labels.clone(), torch.as_tensor(counts).clone()))
        return balanced_softmax_loss(logits, labels, counts, **kwargs)

    monkeypatch.setattr(fed_mas_client, "balanced_softmax_loss", spy_bsm)
    forwards, distances = spy_training_steps(trainer, monkeypatch)
    trainer.train_round(RoundContext(0, 2))
    assert len(forwards) == len(distances) == 9 and len(bsm_calls) == 18  # 3 epochs x 3 batches of 2
    w_hat_sums = np.zeros(3)
    for step, (images, (logits, aux_logits, projected)) in enumerate(forwards):
        labels = labels_of(images)
        for call, head in zip(bsm_calls[2 * step:2 * step + 2], (logits, aux_logits)):
            torch.testing.assert_close(call[0], head, rtol=0, atol=0)
            assert torch.equal(call[1], labels)
            assert torch.equal(call[2].float(), SITE_COUNTS)  # the site's counts, not this batch's
        student, teacher, distance = distances[step]
        torch.testing.assert_close(student, projected, rtol=0, atol=0)
        torch.testing.assert_close(teacher.double(), teacher_by_hand(encoder, images), rtol=1e-5, atol=1e-6)
        w_hat_sums += class_sums(labels, distance)
    site_mix = SITE_COUNTS / SITE_COUNTS.sum()
    assert any(not torch.equal(labels_of(images).bincount(minlength=3) / len(images), site_mix)
               for images, _ in forwards)  # some batch's class mix differs from the site's
    np.testing.assert_allclose(trainer.w_hat.sums.numpy(), w_hat_sums, rtol=1e-6)


# ----- (b) what is this round's only ------------------------------------------------------------------------------
def test_w_w_hat_and_rf_of_a_later_round_come_from_that_round_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spec §2(a) steps 2-4, two rounds on one site: round 2's w is the round-2 global model's divergence, its ŵ
    the L_f of round 2's training steps only (not added to round 1's), and the RF it sends is made of those two."""
    trainer, encoder = tiny_fedmas_trainer(tmp_path)
    first = received_global_model(trainer)
    trainer.receive(first)
    first_rf = trainer.train_round(RoundContext(0, 3))["rf"]
    second = other_global_model(first, seed=2)
    forwards, distances = spy_training_steps(trainer, monkeypatch)
    trainer.receive(second)
    meta = trainer.train_round(RoundContext(1, 3))
    w = hand_global_divergence(second, encoder)
    assert not np.allclose(w, hand_global_divergence(first, encoder), rtol=1e-3)  # the case tells them apart
    np.testing.assert_allclose(trainer.w, w, rtol=1e-5, atol=1e-7)
    assert len(forwards) == len(distances) == 3  # 3 epochs of one (shuffled) full batch
    sums = sum(class_sums(labels_of(images), distance) for (images, _), (_, _, distance) in zip(forwards, distances))
    w_hat = sums / SITE_COUNTS.double().numpy().clip(1)
    np.testing.assert_allclose(trainer.w_hat.per_class(SITE_COUNTS.numpy()), w_hat, rtol=1e-6)
    assert meta["rf"] == pytest.approx(rescue_factor(w, w_hat), rel=1e-5)
    assert meta["rf"] != pytest.approx(first_rf, rel=1e-4)


# ----- (c) which layers the distillation and auxiliary terms reach ------------------------------------------------
def loss_gradients(tmp_path: Path, lambda_f: float, aux_head_weight: float) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the trainer's loss on the tiny site (the same initial model each time)."""
    trainer, _ = tiny_fedmas_trainer(tmp_path, lambda_f=lambda_f, aux_head_weight=aux_head_weight)
    trainer.model.train()
    trainer.compute_loss(W_IMAGES, W_LABELS).backward()
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in
            trainer.model.named_parameters()}


def test_the_distillation_and_auxiliary_terms_reach_every_layer_on_their_path(tmp_path: Path) -> None:
    """Spec §2(a): L_f trains the projector (Linear, BatchNorm, Linear) and through it the backbone; the auxiliary
    BSM (spec §2(e)1, 'balances projector training') trains the auxiliary head, the projector and the backbone."""
    main_only = loss_gradients(tmp_path, lambda_f=0.0, aux_head_weight=0.0)
    with_distance = loss_gradients(tmp_path, lambda_f=3.0, aux_head_weight=0.0)
    with_aux = loss_gradients(tmp_path, lambda_f=0.0, aux_head_weight=1.0)
    projector = [name for name in main_only if name.startswith("projector.")]
    backbone = [name for name in main_only if name.startswith("backbone.")]
    assert len(projector) == 6 and len(backbone) == 2  # two Linear layers and a BatchNorm; one Linear
    for name in projector:
        assert not main_only[name].any(), name  # the main head's BSM alone never reaches the projector
        assert with_distance[name].abs().sum() > 0, f"L_f does not reach {name}"
        assert with_aux[name].abs().sum() > 0, f"the auxiliary BSM does not reach {name}"
    for name in backbone:
        assert not torch.allclose(with_distance[name], main_only[name]), f"L_f does not reach {name}"
        assert not torch.allclose(with_aux[name], main_only[name]), f"the auxiliary BSM does not reach {name}"
    for name in ("aux_head.weight", "aux_head.bias"):
        assert with_aux[name].abs().sum() > 0 and not with_distance[name].any(), name
