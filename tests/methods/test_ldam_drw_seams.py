"""LDAM-DRW's seams (issue 62): the DRW switch as the real trainer reads it over rounds of several epochs, and the
margins from the labels the site's data build produced (a long-tail cut, a missing class)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medflare.methods.base import RoundContext

from ._seams import LONG_TAIL_MISSING, built_train_counts, check_long_tail_reached, site_runtime

ROUNDS = 5  # DRW from round ⌈0.8 · 5⌉ = 4 (0-based): rounds 0-3 uniform, round 4 class-balanced
LOCAL_EPOCHS = 2


def class_balanced_by_hand(counts: np.ndarray, beta: float = 0.9999) -> np.ndarray:
    """Cui et al.'s (1 − β)/(1 − β^n_k), an absent class counted as one, normalised to sum K."""
    weights = (1 - beta) / (1 - beta ** np.maximum(counts, 1))
    return weights * len(counts) / weights.sum()


def weights_per_step(monkeypatch: pytest.MonkeyPatch, runtime, rounds: range) -> dict[int, list[np.ndarray]]:
    """round -> the class weights the LDAM loss received at each step of that round, through ``train_round``."""
    seen: dict[int, list[np.ndarray]] = {}
    loss = runtime.trainer.ldam_loss
    original = loss.forward
    current: list[int] = []

    def spy(logits: torch.Tensor, targets: torch.Tensor, class_weights: torch.Tensor | None = None) -> torch.Tensor:
        ones = np.ones(logits.shape[1])
        seen.setdefault(current[0], []).append(ones if class_weights is None else class_weights.numpy().copy())
        return original(logits, targets, class_weights=class_weights)

    monkeypatch.setattr(loss, "forward", spy)
    for round_index in rounds:
        current[:] = [round_index]
        runtime.trainer.train_round(RoundContext(round_index, ROUNDS))
    return seen


def test_drw_switches_by_federated_round_not_by_epoch_and_holds_for_every_step_of_a_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cao et al. 2019, Algorithm 1 (DRW) as Fed-MAS's LDAM-FL runs it (spec §1.10): uniform weights before round
    ⌈0.8 R⌉, class-balanced (β = 0.9999) from it on. The switch reads the federated round the runtime passes, not the
    job-wide epoch count (with E = 2 local epochs, round 2 is epoch 4), and the weights stay one vector for every step
    of every local epoch of a round."""
    runtime = site_runtime("ldam-drw", LONG_TAIL_MISSING, train={"batch_size": 32, "local_epochs": LOCAL_EPOCHS})
    batches = len(runtime.trainer.train_loader())
    seen = weights_per_step(monkeypatch, runtime, range(ROUNDS))
    balanced = class_balanced_by_hand(built_train_counts(runtime.trainer))
    assert sorted(seen) == list(range(ROUNDS))
    for round_index, steps in seen.items():
        assert len(steps) == LOCAL_EPOCHS * batches  # every step of both epochs went through the LDAM loss
        expected = balanced if round_index >= 4 else np.ones(len(balanced))
        for weights in steps:
            np.testing.assert_allclose(weights, expected, rtol=1e-5, err_msg=f"round {round_index}")
    assert not np.allclose(balanced, 1.0)  # the long tail makes the two regimes differ


def test_margins_come_from_the_labels_the_sites_data_build_produced() -> None:
    """Cao et al. 2019, Eq. 13 (Δ_j ∝ n_j^(−1/4)); spec §1.10 (rescaled to max 0.5): n_j are the counts of the labels
    this site trains on after the job's long-tail cut (data.imbalance) and its split, in which the site lacks a
    class; that class gets margin 0 and is left out of the rescaling."""
    trainers = [site_runtime("ldam-drw", LONG_TAIL_MISSING, site_index, train={"batch_size": 32}).trainer
                for site_index in range(LONG_TAIL_MISSING["num_sites"])]
    check_long_tail_reached(trainers, LONG_TAIL_MISSING["imbalance"])
    for trainer in trainers:
        counts = built_train_counts(trainer)
        present = counts > 0
        expected = np.zeros(len(counts))
        expected[present] = counts[present] ** -0.25
        expected *= 0.5 / expected.max()
        np.testing.assert_allclose(trainer.ldam_loss.margins.numpy(), expected, rtol=1e-6)


def test_the_ldam_loss_reaches_the_cosine_rows_and_every_backbone_layer_but_no_margin() -> None:
    """Cao et al. 2019 §3.2-3.3 (LDAM trains the whole network on normalised features and weights, the margins Δ_j
    fixed by the class counts); spec §1.10: the trainer's loss on its own first batch sends a gradient into every
    row of the cosine head and, through the normalised features, every backbone parameter; the margins are a buffer
    of the loss, never a parameter of the model or of the optimizer."""
    trainer = site_runtime("ldam-drw", LONG_TAIL_MISSING, train={"batch_size": 32}).trainer
    images, labels = next(iter(trainer.train_loader()))
    trainer.model.zero_grad()
    trainer.compute_loss(images, labels).backward()
    for name, parameter in trainer.model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, f"LDAM does not reach {name}"
    assert bool((trainer.model.head.weight.grad.abs().sum(dim=1) > 0).all())  # every class's row
    assert not any(name.endswith("margins") for name, _ in trainer.model.named_parameters())
    assert all(p is not trainer.ldam_loss.margins for p in trainer.parameters_to_train())
