"""MDH-FL through its own loops (issue 51, item 3): what the local epochs and the KL steps hand their losses, the
public set's row order from a site's probabilities through the server to another site's KL steps, what is each
round's own, and which layers a KL step reaches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medflare.data import DataConfig, make_site_data
from medflare.methods.base import RoundContext, TrainConfig
from medflare.methods.local_only import client as local_only_client
from medflare.methods.mdhfl import client as mdhfl_client
from medflare.methods.mdhfl.protocol import (
    DISTILL_PHASE,
    KL_LOSS,
    PRIVATE_LOSS,
    PROBS,
    PROBS_PHASE,
    PUBLIC_ROWS,
    SETUP_PHASE,
    TARGET,
)
from medflare.methods.mdhfl.targets import mixed_target_loss
from medflare.models import create_model
from medflare.registry import get_method
from medflare.server_round import RoundAggregation

from .test_mdhfl_invariants import hand_sce

K = 3
SIZE = 12


def site(index: int = 0, n: int = 60, sites: int = 2, **method_args):
    """An MDH-FL site with its method's optimizer settings (batch 8), noisy training labels and a public set of
    0.4·n images (24 of 60), the same at every site."""
    data = DataConfig(source=f"synthetic:n={n},classes={K},size={SIZE},n_val=9,n_test=9", num_sites=sites,
                      public_fraction=0.4, augment="none", label_noise=0.3, noise_kind="pairflip")
    spec = get_method("mdhfl")
    torch.manual_seed(index)
    model = create_model("cnn", K, 3, image_size=SIZE)
    train = TrainConfig(**{**spec.train_defaults, "batch_size": 8})
    return spec.trainer_cls(model, make_site_data(data, index), train, spec.config_cls(**method_args), spec.payload,
                            torch.device("cpu"), log=lambda m: None)


def images_of(dataset) -> torch.Tensor:
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def rows_of(images: torch.Tensor, every: torch.Tensor) -> list[int]:
    """Which row of ``every`` each image is (exactly: no augmentation anywhere here)."""
    distance = (images[:, None] - every[None]).flatten(2).abs().amax(dim=2)
    assert (distance.min(dim=1).values == 0).all()
    return distance.argmin(dim=1).tolist()


def spy_student(trainer, monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, logits) of every forward of the site model with gradients on (its training steps)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = trainer.model.forward

    def student(x: torch.Tensor) -> torch.Tensor:
        logits = forward(x)
        if torch.is_grad_enabled():
            calls.append((x.clone(), logits.detach().clone()))
        return logits

    monkeypatch.setattr(trainer.model, "forward", student)
    return calls


def spy_kl(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, target rows) of every KL step's loss."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def kl(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append((logits.detach().clone(), target.clone()))
        return mixed_target_loss(logits, target)

    monkeypatch.setattr(mdhfl_client, "mixed_target_loss", kl)
    return calls


def distinct_target(rows: int) -> np.ndarray:
    """A T_p whose rows all differ (row sums s_p < 1, as the others' weights give)."""
    target = np.zeros((rows, K), np.float32)
    target[:, 0] = np.linspace(0.05, 0.45, rows)
    target[:, 1] = 0.5 - target[:, 0]
    return target


# ----- (a) what the local epochs hand their loss --------------------------------------------------------------
def test_each_round_trains_e_l_epochs_of_sce_on_the_sites_own_noisy_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spec §3(a) step 4 and §3(e) through train_round: E_l = max(N_public // N_private, 1) = 80 // 30 = 2 epochs
    of SCE(α 0.1, β 1.0), each step's loss given the model's logits on the batch and those images' (noisy) labels."""
    trainer = site(n=200, sites=4)
    assert (len(trainer.data.public), len(trainer.data.train)) == (80, 30)
    private, labels = images_of(trainer.data.train), torch.as_tensor(trainer.data.train.labels)
    losses: list[tuple[torch.Tensor, torch.Tensor, float, float]] = []
    symmetric_cross_entropy = local_only_client.symmetric_cross_entropy

    def sce(logits: torch.Tensor, targets: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        losses.append((logits.detach().clone(), targets.clone(), alpha, beta))
        return symmetric_cross_entropy(logits, targets, alpha, beta)

    monkeypatch.setattr(local_only_client, "symmetric_cross_entropy", sce)
    forwards = spy_student(trainer, monkeypatch)
    epochs: list[int] = []
    trainer.epoch_listener = lambda epoch, loss: epochs.append(epoch)
    trainer.train_round(RoundContext(0, 2))
    assert epochs == [0, 1] and len(losses) == len(forwards) == 6  # 2 epochs of 3 batches of 8 (drop_last)
    for (images, logits), (given_logits, targets, alpha, beta) in zip(forwards, losses):
        torch.testing.assert_close(given_logits, logits, rtol=0, atol=0)
        assert torch.equal(targets, labels[rows_of(images, private)]) and (alpha, beta) == (0.1, 1.0)


def test_the_warm_up_trains_pretrain_epochs_and_the_rounds_go_back_to_e_l() -> None:
    """RHFL's warm-up (spec §3(a), pretrain_epochs) runs its own number of epochs before the first exchange."""
    trainer = site(pretrain_epochs=3, local_epochs=2)
    epochs: list[int] = []
    trainer.epoch_listener = lambda epoch, loss: epochs.append(epoch)
    trainer.run_phase(SETUP_PHASE, {}, RoundContext(0, 2))
    assert epochs == [0, 1, 2]
    epochs.clear()
    trainer.train_round(RoundContext(0, 2))
    assert epochs == [0, 1]


# ----- (d) the public set's row order ----------------------------------------------------------------------------
def test_shared_probabilities_follow_the_public_sets_row_order() -> None:
    """Row i of what a site sends is its softmax on public row (first + i) mod N₀, also across the wrap-around."""
    trainer = site(probs_dtype="float32")
    public = images_of(trainer.data.public)
    assert len(public) == 24
    arrays, _ = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([20, 16])}, RoundContext(0, 2))
    trainer.model.eval()
    with torch.no_grad():
        expected = torch.softmax(trainer.model(public[(20 + np.arange(16)) % 24]), dim=1).numpy()
    assert ((expected[:, None] - expected[None]).max(axis=2) + np.eye(16)).min() > 1e-5  # rows tell apart
    np.testing.assert_allclose(arrays[PROBS], expected, rtol=0, atol=1e-6)


def test_each_kl_step_pairs_a_public_row_with_its_own_target_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KL steps walk the chunk's rows in the public set's order and give each image its own row of T_p."""
    trainer = site()
    public = images_of(trainer.data.public)
    trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([20, 16])}, RoundContext(0, 2))
    target = distinct_target(16)
    forwards, losses = spy_student(trainer, monkeypatch), spy_kl(monkeypatch)
    trainer.run_phase(DISTILL_PHASE, {TARGET: target}, RoundContext(0, 2))
    assert len(forwards) == len(losses) == 2  # 16 rows in batches of 8
    for (images, logits), (given_logits, given_target) in zip(forwards, losses):
        chunk_rows = [(row - 20) % 24 for row in rows_of(images, public)]
        torch.testing.assert_close(given_logits, logits, rtol=0, atol=0)
        np.testing.assert_array_equal(given_target.numpy(), target[chunk_rows])
    assert [row for images, _ in forwards for row in rows_of(images, public)] == [(20 + i) % 24 for i in range(16)]


def test_a_site_distils_towards_the_other_sites_probabilities_of_the_same_public_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Site → server → site: with two sites in round 0 (w = 1 for the other one), the target row each KL step of
    site 2 gets for a public image is site 1's probability of that very image."""
    sites = {"site-1": site(0, probs_dtype="float32"), "site-2": site(1, probs_dtype="float32")}
    ctx = RoundContext(0, 2)
    core = RoundAggregation(get_method("mdhfl"), {"public_per_round": 16, "probs_dtype": "float32"}, num_classes=K, num_rounds=2)
    core.start_round({}, ctx)
    core.start_phase(SETUP_PHASE)
    for name, trainer in sites.items():
        assert core.accept(name, *trainer.run_phase(SETUP_PHASE, {}, ctx)) is None
    rows = core.start_phase(PROBS_PHASE)[PUBLIC_ROWS]
    sent = {}
    for name, trainer in sites.items():
        sent[name] = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: rows}, ctx)
        assert core.accept(name, *sent[name]) is None
    learner = sites["site-2"]
    public, first = images_of(learner.data.public), int(rows[0])
    forwards, losses = spy_student(learner, monkeypatch), spy_kl(monkeypatch)
    learner.receive(core.start_phase("train").arrays["site-2"])
    learner.train_round(ctx)
    assert len(losses) == 2
    for (images, _), (_, given_target) in zip(forwards, losses):
        teacher_rows = [(row - first) % len(public) for row in rows_of(images, public)]
        np.testing.assert_allclose(given_target.numpy(), sent["site-1"][0][PROBS][teacher_rows], atol=1e-6)


# ----- (b) what is each round's own --------------------------------------------------------------------------------
def test_the_private_loss_the_kl_loss_and_the_local_adam_are_each_rounds_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds on one site: the private loss CCR reads is sent again in round 2 and is the round-2 model's
    (spec §3(a) step 1); a round without a target reports no KL loss (not round 1's); the local epochs' Adam is
    new each round (spec §3(a) step 4: 'discarded afterwards')."""
    trainer = site()
    private, labels = images_of(trainer.data.train), torch.as_tensor(trainer.data.train.labels)
    first_loss = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 16])}, RoundContext(0, 2))[1]
    trainer.receive({TARGET: distinct_target(16)})
    assert KL_LOSS in trainer.train_round(RoundContext(0, 2))
    optimizer = trainer.optimizer
    trainer.model.eval()
    with torch.no_grad():
        expected = hand_sce(trainer.model(private), labels, 0.1, 1.0)
    second_loss = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([16, 16])}, RoundContext(1, 2))[1]
    assert second_loss[PRIVATE_LOSS] == pytest.approx(expected, rel=1e-5)
    assert second_loss[PRIVATE_LOSS] != pytest.approx(first_loss[PRIVATE_LOSS], rel=1e-3)
    trainer.receive({})  # this site missed the chunk: no target this round
    assert KL_LOSS not in trainer.train_round(RoundContext(1, 2))
    assert trainer.optimizer is not optimizer
    steps = len(trainer.data.train) // 8 * trainer.train_cfg.local_epochs
    assert {int(state["step"]) for state in trainer.optimizer.state.values()} == {steps}


# ----- (c) which layers a KL step reaches ----------------------------------------------------------------------------
def test_a_kl_step_reaches_and_moves_every_layer_of_the_site_model() -> None:
    """The distillation term trains the whole site model (spec §3(a) step 3: every client takes a step on it)."""
    trainer = site()
    trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, RoundContext(0, 2))  # one step of 8 rows
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.run_phase(DISTILL_PHASE, {TARGET: distinct_target(8)}, RoundContext(0, 2))
    for name, parameter in trainer.model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, f"the KL term does not reach {name}"
        assert not torch.equal(parameter.detach(), before[name]), f"the KL step does not move {name}"
