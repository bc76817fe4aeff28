"""FedLSM through its own training loop (issue 51, item 3): which rows and targets each loss term gets from the
trainer, what is each round's own and what carries over, and which layers each loss term reaches."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from medflare.data import DataConfig, make_site_data
from medflare.methods.base import RoundContext, TrainConfig
from medflare.methods.fedlsm import SPEC, FedLsmConfig, client as fedlsm_client
from medflare.methods.fedlsm.pseudo import mixup, single_label_targets, soft_cross_entropy

from .test_fedlsm import fedlsm_trainer, tiny_net

SOURCE = "synthetic:n=60,classes=3,size=8"  # site 0 of labelset:2 annotates 2 of the 3 classes
UNCERTAIN, CONFIDENT = 4, 6  # fedlsm_trainer's n^h and n^l


@dataclass
class Calls:
    """What the loss functions and the student were given during training, in call order."""

    targets: list[tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]]  # (labels, tau, pseudo classes, result)
    mixups: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]  # (x_l, x_h, y_l, y_h), result
    losses: list[tuple[torch.Tensor, torch.Tensor]]  # (logits, targets) of each soft cross-entropy
    student: list[tuple[torch.Tensor, torch.Tensor]]  # (input, logits) of each training forward


def spy_on_training(trainer: fedlsm_client.FedLsmTrainer, monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls = Calls([], [], [], [])

    def targets(labels, probs, tau, pseudo_classes):
        result = single_label_targets(labels, probs, tau, pseudo_classes)
        calls.targets.append((labels.clone(), tau, pseudo_classes.clone(), result.clone()))
        return result

    def mixed(x_l, x_h, y_l, y_h, valid, lam):
        result = mixup(x_l, x_h, y_l, y_h, valid, lam)
        calls.mixups.append(((x_l.clone(), x_h.clone(), y_l.clone(), y_h.clone()), tuple(t.clone() for t in result)))
        return result

    def cross_entropy(logits, target):
        calls.losses.append((logits.detach().clone(), target.clone()))
        return soft_cross_entropy(logits, target)

    forward = trainer.model.forward

    def student(x):
        logits = forward(x)
        if torch.is_grad_enabled():
            calls.student.append((x.clone(), logits.detach().clone()))
        return logits

    monkeypatch.setattr(fedlsm_client, "single_label_targets", targets)
    monkeypatch.setattr(fedlsm_client, "mixup", mixed)
    monkeypatch.setattr(fedlsm_client, "soft_cross_entropy", cross_entropy)
    monkeypatch.setattr(trainer.model, "forward", student)
    return calls


def plain_images(trainer: fedlsm_client.FedLsmTrainer) -> torch.Tensor:
    return torch.stack([trainer.plain[i][0][0] for i in range(len(trainer.plain))])


def pools_by_hand(trainer: fedlsm_client.FedLsmTrainer) -> tuple[set[int], set[int]]:
    """(D^h, D^l) of the model as it is now: the most and least entropic softmax, eval mode, plain views."""
    model = copy.deepcopy(trainer.model).eval()
    with torch.no_grad():
        entropy = torch.special.entr(torch.softmax(model(plain_images(trainer)), dim=1)).sum(dim=1)
    order = torch.argsort(entropy, stable=True).tolist()
    return set(order[-UNCERTAIN:]), set(order[:CONFIDENT])


def rows_of(images: torch.Tensor, plain: torch.Tensor) -> list[int]:
    """The training image each row is (plain views only: the MixUp partners are not augmented)."""
    distance = (images[:, None] - plain[None]).flatten(2).abs().amax(dim=2)
    assert (distance.min(dim=1).values < 1e-6).all()
    return distance.argmin(dim=1).tolist()


# ----- (a) what each loss term receives from the training loop --------------------------------------------------
def test_the_trainer_hands_the_losses_its_pools_rows_the_unannotated_classes_and_the_mixed_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spec §5(a)3-5 through train_round: D^h partners are the most uncertain images under the received model,
    D^l partners the least (each with its own label), pseudo-labels only at the classes the site does not annotate
    (τ on the pool and D^l, τ_l on D^h); the student's pool logits meet the pool targets and its logits on the
    mixed images meet the mixed targets."""
    trainer = fedlsm_trainer(SOURCE)
    trainer.cfg.local_iterations = 2
    uncertain, confident = pools_by_hand(trainer)
    plain, labels = plain_images(trainer), torch.as_tensor(trainer.data.train.labels)
    unannotated = ~torch.as_tensor(trainer.data.identified)
    calls = spy_on_training(trainer, monkeypatch)
    trainer.train_round(RoundContext(0, 2))
    rows = trainer.pool_rows
    assert len(calls.mixups) == len(calls.student) == 2 and len(calls.targets) == 6 and len(calls.losses) == 4
    for step, ((x_l, x_h, y_l, y_h), (mixed_x, mixed_y, _)) in enumerate(calls.mixups):
        pool, partners_h, partners_l = calls.targets[3 * step:3 * step + 3]
        assert [tau for _, tau, _, _ in (pool, partners_h, partners_l)] == [0.95, 0.85, 0.95]
        assert all(torch.equal(pseudo_classes, unannotated) for _, _, pseudo_classes, _ in (pool, partners_h, partners_l))
        assert set(rows_of(x_h, plain)) <= uncertain and set(rows_of(x_l, plain)) <= confident
        assert torch.equal(partners_h[0], labels[rows_of(x_h, plain)])
        assert torch.equal(partners_l[0], labels[rows_of(x_l, plain)])
        assert torch.equal(y_h, partners_h[3]) and torch.equal(y_l, partners_l[3])
        student_input, logits = calls.student[step]
        torch.testing.assert_close(student_input[rows:], mixed_x, rtol=0, atol=0)
        (pool_logits, pool_targets), (mixed_logits, mixed_targets) = calls.losses[2 * step:2 * step + 2]
        torch.testing.assert_close(pool_logits, logits[:rows], rtol=0, atol=0)
        torch.testing.assert_close(mixed_logits, logits[rows:], rtol=0, atol=0)
        assert torch.equal(pool_targets, pool[3]) and torch.equal(mixed_targets, mixed_y)


# ----- (b) what is each round's own, and what carries over -------------------------------------------------------
def spec_trainer(**method_args) -> fedlsm_client.FedLsmTrainer:
    """A single-label FedLSM site trained with the method's own optimizer settings (Adam), batches of 12."""
    data = make_site_data(DataConfig(source=SOURCE, partition="labelset:2", num_sites=2), 0)
    cfg = FedLsmConfig(local_iterations=3, uncertain_pool=UNCERTAIN, confident_pool=CONFIDENT, **method_args)
    train = TrainConfig(**{**SPEC.train_defaults, "batch_size": 12})
    return fedlsm_client.FedLsmTrainer(tiny_net(data.num_classes), data, train, cfg, SPEC.payload,
                                       torch.device("cpu"), log=lambda m: None)


def receive_another_global_model(trainer: fedlsm_client.FedLsmTrainer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in trainer.model.state_dict().items():
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=generator)
                tensor.add_(noise.abs() if key.endswith("running_var") else noise)


def test_pools_and_q_are_each_rounds_own_while_the_adam_moments_carry_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spec §5(a)1-4, two rounds on one site: round 2's D^h and D^l come from round 2's received model, its q^k
    counts round 2's draws only, and the site's Adam keeps its moments from round 1 ('restore its previous state')."""
    trainer = spec_trainer()
    trainer.train_round(RoundContext(0, 2))
    first_pools, optimizer = (set(trainer.uncertain), set(trainer.confident)), trainer.optimizer
    receive_another_global_model(trainer, seed=3)
    pools = pools_by_hand(trainer)
    assert pools != first_pools  # the case tells them apart
    calls = spy_on_training(trainer, monkeypatch)
    meta = trainer.train_round(RoundContext(1, 2))
    assert (set(trainer.uncertain.tolist()), set(trainer.confident.tolist())) == pools
    drawn = sum(result.sum(dim=0) for _, _, _, result in calls.targets[0::3])  # the pool rows' targets
    assert len(calls.targets) == 9 and meta["q"] == pytest.approx(drawn.double().tolist())
    assert trainer.optimizer is optimizer and isinstance(optimizer, torch.optim.Adam)
    assert {int(state["step"]) for state in optimizer.state.values()} == {6}  # 3 steps a round, 2 rounds


# ----- (c) which layers each loss term reaches ------------------------------------------------------------------
@pytest.mark.parametrize("term", ["pool", "mixup"])
def test_each_loss_term_reaches_every_student_layer_and_never_the_teacher(
    term: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's soft cross-entropy alone (w/o UDE) and the UDE term alone (no pool row has a target) each give
    every layer of the student a gradient; the EMA teacher gets none (spec §5(a)4-5, §1.6)."""
    trainer = fedlsm_trainer(SOURCE, ude=term == "mixup")
    images, labels = trainer.draw_batch()
    teacher = trainer.teacher.model
    if term == "mixup":
        annotated = int(torch.nonzero(torch.as_tensor(trainer.data.identified))[0])
        labels[:trainer.pool_rows], labels[trainer.pool_rows:] = -1, annotated
        monkeypatch.setattr(trainer.teacher, "model", lambda x: torch.zeros(len(x), 3))  # unsure: no pseudo-label
    trainer.model.train()
    trainer.compute_loss(images, labels).backward()
    for name, parameter in trainer.model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, f"the {term} term does not reach {name}"
    assert all(parameter.grad is None for parameter in teacher.parameters())

