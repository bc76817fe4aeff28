"""FedLSM: AWPA and masked rows by hand, pseudo-label thresholds, UDE MixUp, the EMA teacher, UE in eval mode,
q^k, the multi-label set-up phase and the per-element weighted BCE."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

from medflare import contracts
from medflare.data import DataConfig, make_site_data
from medflare.errors import ConfigError, PayloadError
from medflare.losses import weighted_bce
from medflare.methods.base import RoundContext, SiteUpdate, TrainConfig
from medflare.methods.fedavg_masked import SPEC as MASKED_SPEC, FedAvgMaskedConfig
from medflare.methods.fedavg_masked.client import FedAvgMaskedTrainer
from medflare.methods.fedlsm import SPEC, FedLsmConfig, client as fedlsm_client
from medflare.methods.fedlsm.client import identified_classes
from medflare.methods.fedlsm.pseudo import (
    element_weights,
    global_pos_weight,
    mixup,
    multi_label_targets,
    pool_size,
    sample_uncertainty,
    single_label_targets,
    soft_cross_entropy,
    split_pools,
)
from medflare.methods.fedlsm.server import LABEL_COUNTS, POS_WEIGHT, FedLsmRule
from medflare.models import Classifier, EmaTeacher
from medflare.registry import get_method
from medflare.server_round import RoundAggregation

# ----- server: AWPA, masked rows, fallback ------------------------------------------------------------

HEAD = {"head.weight": np.arange(6, dtype=np.float64).reshape(3, 2), "head.bias": np.zeros(3)}


def site_update(site: str, scale: float, n: float, q: list[float], identified: list[float]) -> SiteUpdate:
    arrays = {"backbone.w": np.full(2, scale), "head.weight": np.full((3, 2), scale), "head.bias": np.full(3, scale)}
    return SiteUpdate(site, arrays, {contracts.N_SAMPLES: n, "q": q, "identified": identified})


UPDATES = [
    site_update("a", 1.0, n=100, q=[30, 0, 0], identified=[1, 0, 0]),
    site_update("b", 2.0, n=300, q=[10, 20, 0], identified=[1, 1, 0]),
    site_update("c", 4.0, n=100, q=[0, 60, 0], identified=[0, 1, 0]),
]


def aggregate(aggregation: str, updates=UPDATES) -> dict[str, np.ndarray]:
    rule = FedLsmRule(FedLsmConfig(aggregation=aggregation), 5, SPEC.payload)
    global_params = {"backbone.w": np.zeros(2), **HEAD}
    return rule.aggregate(global_params, updates, RoundContext(0, 5)).params


def test_awpa_rows_are_weighted_by_q_and_fall_back_to_n_where_nobody_counted() -> None:
    params = aggregate("awpa")
    n_weighted = (100 * 1 + 300 * 2 + 100 * 4) / 500  # extractor and the row nobody has a count for
    np.testing.assert_allclose(params["backbone.w"], n_weighted)
    rows = [(30 * 1 + 10 * 2) / 40, (20 * 2 + 60 * 4) / 80, n_weighted]
    np.testing.assert_allclose(params["head.weight"], np.repeat(np.array(rows)[:, None], 2, axis=1))
    np.testing.assert_allclose(params["head.bias"], rows)  # bias entries use the same per-class weights


def test_masked_rows_average_over_the_sites_that_annotate_each_class() -> None:
    params = aggregate("masked")
    rows = [(100 * 1 + 300 * 2) / 400, (300 * 2 + 100 * 4) / 400, (100 * 1 + 300 * 2 + 100 * 4) / 500]
    np.testing.assert_allclose(params["head.bias"], rows)
    plain = aggregate("samples")
    np.testing.assert_allclose(plain["head.bias"], rows[2])


def test_baseline_fedavg_masked_uses_the_same_rows() -> None:
    core = RoundAggregation(get_method("fedavg-masked"), {}, num_classes=3, num_rounds=2)
    global_params = {"backbone.w": np.zeros(2), **HEAD}
    result = core.rule.aggregate(global_params, UPDATES, RoundContext(0, 2))
    np.testing.assert_allclose(result.params["head.bias"], aggregate("masked")["head.bias"])


def test_an_update_without_q_is_rejected_for_awpa() -> None:
    rule = FedLsmRule(FedLsmConfig(), 5, SPEC.payload)
    update = SiteUpdate("a", {}, {contracts.N_SAMPLES: 10})
    with pytest.raises(PayloadError, match="needs 'q'"):
        rule.site_weight(update, RoundContext(0, 5))


# ----- server: the multi-label set-up phase -----------------------------------------------------------


def test_pos_weight_is_negatives_over_positives_summed_over_sites() -> None:
    weights = global_pos_weight([[2, 0, 5], [3, 0, 0]], [[8, 10, 5], [12, 4, 9]])
    np.testing.assert_allclose(weights, [20 / 5, 1.0, 14 / 5])  # no positive anywhere: 1


def test_multi_label_rule_runs_label_counts_first_and_sends_pos_weight_every_round() -> None:
    core = RoundAggregation(get_method("fedlsm"), {}, num_classes=3, num_rounds=3, multi_label=True)
    global_params = {"head.bias": np.zeros(3, np.float32)}
    assert core.rule.phases(RoundContext(0, 3)) == [LABEL_COUNTS, "train"]
    core.start_round(global_params, RoundContext(0, 3))
    assert core.start_phase(LABEL_COUNTS) == {}
    for site, pos in (("a", [1, 2, 0]), ("b", [3, 0, 0])):
        counts = np.array(pos, dtype=np.int64)
        assert core.accept(site, {"positives": counts, "negatives": 10 - counts}, {}) is None
    sent = core.start_phase("train")
    np.testing.assert_allclose(sent[POS_WEIGHT], [(9 + 7) / 4, (8 + 10) / 2, 1.0])
    assert set(sent) == {"head.bias", POS_WEIGHT}
    assert core.rule.phases(RoundContext(1, 3)) == ["train"]  # kept for the job
    later = core.rule.phase_arrays("train", RoundContext(1, 3), global_params, {})
    np.testing.assert_array_equal(later[POS_WEIGHT], sent[POS_WEIGHT])
    restarted = RoundAggregation(get_method("fedlsm"), {}, num_classes=3, num_rounds=3, multi_label=True)
    assert restarted.rule.phases(RoundContext(2, 3)) == [LABEL_COUNTS, "train"]  # no pos_weight: ask again
    single = RoundAggregation(get_method("fedlsm"), {}, num_classes=3, num_rounds=3)
    assert single.rule.phases(RoundContext(0, 3)) == ["train"]


def test_negative_or_fractional_counts_are_refused() -> None:
    core = RoundAggregation(get_method("fedlsm"), {}, num_classes=3, num_rounds=3, multi_label=True)
    core.start_round({"head.bias": np.zeros(3, np.float32)}, RoundContext(0, 3))
    core.start_phase(LABEL_COUNTS)
    assert "below 0" in core.accept("a", {"positives": np.array([-1, 0, 0]), "negatives": np.zeros(3, np.int64)}, {})
    assert "whole numbers" in core.accept("b", {"positives": np.array([0.5, 0, 0]), "negatives": np.zeros(3)}, {})


# ----- pseudo-labels, MixUp, weights --------------------------------------------------------------------


def test_single_label_pseudo_labels_need_tau_and_an_unannotated_class() -> None:
    labels = torch.tensor([2, -1, -1, -1, -1])
    probs = torch.tensor([[0.1, 0.1, 0.8], [0.95, 0.05, 0.0], [0.94, 0.06, 0.0], [0.0, 0.97, 0.03], [0.0, 0.0, 1.0]],
                         dtype=torch.float64)
    unannotated = torch.tensor([True, True, False])  # the site labels class 2 only
    targets = single_label_targets(labels, probs, 0.95, unannotated)
    expected = [[0, 0, 1], [1, 0, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0]]  # GT; =τ; <τ; ≥τ; an annotated class
    np.testing.assert_array_equal(targets.numpy(), expected)


def test_multi_label_pseudo_labels_at_tau_pos_and_tau_neg() -> None:
    labels = torch.tensor([[1, -1, -1, -1, -1]])
    probs = torch.tensor([[0.01, 0.85, 0.84, 0.005, 0.006]], dtype=torch.float64)
    targets, valid = multi_label_targets(labels, probs, tau_pos=0.85, tau_neg=0.005)
    np.testing.assert_array_equal(targets.numpy(), [[1, 1, 0, 0, 0]])  # a known entry keeps its label
    np.testing.assert_array_equal(valid.numpy(), [[True, True, False, True, False]])


def test_mixup_mixes_confident_and_uncertain_rows_with_one_lambda_and_masks_invalid_targets() -> None:
    x_l, x_h = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    y_l, y_h = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mixed_x, mixed_y, _ = mixup(x_l, x_h, y_l, y_h, torch.tensor([True, False]), lam=0.3)
    assert torch.all(mixed_x == 0.3)  # λ·x_l + (1−λ)·x_h
    np.testing.assert_allclose(mixed_y.numpy(), [[0.3, 0.7], [0.0, 0.0]])


def test_lambda_is_drawn_from_beta_alpha_alpha_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8", mixup_alpha=0.2)
    draws = np.array([trainer.mixup_lambda() for _ in range(4000)])
    assert abs(draws.mean() - 0.5) < 0.02 and abs(draws.var() - 1 / (4 * (2 * 0.2 + 1))) < 0.01
    assert ((draws < 0.1) | (draws > 0.9)).mean() > 0.5  # Beta(0.2, 0.2) is U-shaped
    seen = []

    def spy(x_l, x_h, y_l, y_h, valid, lam):
        seen.append(lam)
        return mixup(x_l, x_h, y_l, y_h, valid, lam)

    monkeypatch.setattr(fedlsm_client, "mixup", spy)
    monkeypatch.setattr(trainer, "mixup_lambda", lambda: 0.3)
    trainer.compute_loss(*trainer.draw_batch())
    assert seen == [0.3]  # one scalar λ for the whole batch


def test_uncertain_unknown_entries_get_no_gradient_unless_repo_compat() -> None:
    """Per-element weighting (spec §5(e)2): an uncertain unknown entry has weight 0 and no gradient; the authors'
    mean-then-weight reduction (repo_compat) trains it towards the teacher's soft score instead."""
    labels = torch.tensor([[1, -1, -1]])
    teacher = torch.tensor([[0.7, 0.5, 0.001]])
    targets, valid = multi_label_targets(labels, teacher, 0.85, 0.005)
    weights = element_weights(targets, valid, torch.tensor([4.0, 2.0, 3.0]), "element")
    np.testing.assert_allclose(weights.numpy(), [[4.0, 0.0, 3.0]])
    logits = torch.tensor([[0.2, -0.4, 1.0]], requires_grad=True)
    weighted_bce(logits, targets, weights).backward()
    assert logits.grad[0, 1] == 0 and logits.grad[0, 0] != 0 and logits.grad[0, 2] != 0
    logits.grad = None
    soft = torch.where(valid, targets, teacher)
    (torch.nn.functional.binary_cross_entropy_with_logits(logits, soft) * weights.mean()).backward()
    assert logits.grad[0, 1] != 0
    positive_only = element_weights(targets, valid, torch.tensor([4.0, 2.0, 3.0]), "positive")
    np.testing.assert_allclose(positive_only.numpy(), [[4.0, 0.0, 1.0]])


# ----- uncertainty and pools ------------------------------------------------------------------------------


def test_uncertainty_by_hand() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    single = sample_uncertainty(logits, torch.tensor([0, -1]), multi_label=False)
    np.testing.assert_allclose(single.numpy(), [math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))])
    labels = torch.tensor([[1, -1], [-1, -1]])
    multi = sample_uncertainty(logits, labels, multi_label=True)
    h = lambda p: -(p * math.log(p) + (1 - p) * math.log(1 - p)) / math.log(2)  # noqa: E731
    np.testing.assert_allclose(multi.numpy(), [1.0, (h(0.75) + 1.0) / 2])  # only unknown entries count
    code = sample_uncertainty(logits, labels, multi_label=True, repo_compat=True)
    np.testing.assert_allclose(code.numpy(), [0.5 * math.log(2) / 2, (0.75 * math.log(4 / 3) + 0.5 * math.log(2)) / 2])


def test_pools_take_the_most_and_least_uncertain_and_pseudo_excludes_d_h() -> None:
    uncertain, confident, pseudo = split_pools(torch.tensor([0.5, 0.9, 0.1, 0.7, 0.2, 0.8]), 2, 2)
    assert uncertain.tolist() == [1, 5] and confident.tolist() == [2, 4] and pseudo.tolist() == [0, 2, 3, 4]
    assert pool_size(0.25, 40) == 10 and pool_size(7, 40) == 7 and pool_size(0.001, 40) == 1


# ----- the EMA teacher -------------------------------------------------------------------------------------


def test_ema_update_mixes_parameters_and_copies_buffers() -> None:
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).double()
    teacher = EmaTeacher(student, decay=0.9)
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    with torch.no_grad():
        for param in student.parameters():
            param.add_(1.0)
    student.train()(torch.randn(8, 3, dtype=torch.float64))  # moves the BN running statistics
    teacher.update(student)
    after, now = teacher.model.state_dict(), student.state_dict()
    for name, _ in student.named_parameters():
        torch.testing.assert_close(after[name], 0.9 * before[name] + 0.1 * now[name])
    for name, _ in student.named_buffers():
        torch.testing.assert_close(after[name], now[name])
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())


# ----- the trainer on real (tiny) site data ----------------------------------------------------------------


def tiny_net(num_classes: int) -> Classifier:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 6), nn.BatchNorm1d(6), nn.ReLU())
    return Classifier(backbone, nn.Linear(6, num_classes))


def fedlsm_trainer(source: str, partition: str = "labelset:2", **method_args) -> fedlsm_client.FedLsmTrainer:
    data = make_site_data(DataConfig(source=source, partition=partition, num_sites=2), 0)
    cfg = FedLsmConfig(local_iterations=3, uncertain_pool=4, confident_pool=6, **method_args)
    train = TrainConfig(batch_size=12, lr=1e-3)
    trainer = fedlsm_client.FedLsmTrainer(tiny_net(data.num_classes), data, train, cfg, SPEC.payload,
                                          torch.device("cpu"), log=lambda m: None)
    if data.multi_label:
        trainer.receive({POS_WEIGHT: np.full(data.num_classes, 2.0, np.float32)})
    trainer.on_round_start(RoundContext(0, 2))
    return trainer


def test_uncertainty_uses_eval_mode_and_leaves_batchnorm_statistics_alone() -> None:
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8")
    trainer.model.train()
    stats = trainer.model.backbone[2].running_mean.clone()
    scores = trainer.uncertainty()
    assert torch.equal(trainer.model.backbone[2].running_mean, stats)
    with torch.no_grad():
        trainer.model.eval()
        plain = torch.stack([trainer.plain[i][0][0] for i in range(len(trainer.plain))])
        expected = sample_uncertainty(trainer.model(plain), torch.as_tensor(trainer.data.train.labels), False)
    torch.testing.assert_close(scores, expected)


def test_batches_hold_pool_rows_with_two_views_then_the_mixup_partners() -> None:
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8")
    images, labels = trainer.draw_batch()
    # batch_size 12 = 8 pool rows + 4 mixed rows; the 4 mixed rows come from 4 D^h and 4 D^l images
    assert trainer.pool_rows == 8 and images.shape == (16, 2, 3, 8, 8) and labels.shape == (16,)
    partners = images[trainer.pool_rows:]
    assert torch.equal(partners[:, 0], partners[:, 1])  # the plain view, twice
    assert len(trainer.train_loader()) == 3


def test_q_counts_labels_and_pseudo_labels_per_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """A teacher sure of class 2 pseudo-labels every unlabelled pool row; q adds labels and pseudo-labels."""
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8", partition="iid")
    trainer.pseudo_classes = torch.tensor([False, False, True])
    monkeypatch.setattr(trainer.teacher, "model", lambda x: torch.tensor([[0.0, 0.0, 20.0]]).repeat(len(x), 1))
    images, labels = trainer.draw_batch()
    labels[:3] = -1
    trainer.compute_loss(images, labels)
    pool = labels[: trainer.pool_rows]
    expected = np.bincount(pool[pool >= 0].numpy(), minlength=3) + np.array([0, 0, 3])
    np.testing.assert_array_equal(trainer.q.numpy(), expected)


def test_a_round_trains_and_sends_q_and_the_whole_training_set_size() -> None:
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8")
    meta = trainer.train_round(RoundContext(0, 2))
    assert meta[contracts.N_SAMPLES] == len(trainer.data.train) == 30
    assert len(meta["q"]) == 3 and sum(meta["q"]) > 0 and "identified" not in meta
    SPEC.payload.check_outgoing({}, meta, [], contracts.ContractContext(3), phase="train")


def test_multi_label_round_needs_pos_weight_and_answers_the_label_counts_phase() -> None:
    trainer = fedlsm_trainer("synthetic:multilabel=1,classes=4,n=60,size=8")
    meta = trainer.train_round(RoundContext(0, 2))
    assert len(meta["q"]) == 4 and math.isfinite(meta[contracts.TRAIN_LOSS])
    arrays, _ = trainer.run_phase(LABEL_COUNTS, {}, RoundContext(0, 2))
    labels = trainer.data.train.labels
    np.testing.assert_array_equal(arrays["positives"], (labels == 1).sum(axis=0))
    np.testing.assert_array_equal(arrays["positives"] + arrays["negatives"], len(labels))
    trainer.receive({})
    with pytest.raises(PayloadError, match="needs the server's pos_weight"):
        trainer.train_round(RoundContext(1, 2))


def test_partners_get_pseudo_labels_unless_repo_compat(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spec §5(e)1: with a confident teacher, unlabelled MixUp partners are pseudo-labelled (the paper); the
    authors' code gives them none, so every pair with an unlabelled partner has no target."""
    mixed_targets = {}
    for compat in (False, True):
        trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8", repo_compat=compat)
        monkeypatch.setattr(trainer.teacher, "model", lambda x: torch.tensor([[20.0, 0.0, 0.0]]).repeat(len(x), 1))

        def spy(x_l, x_h, y_l, y_h, valid, lam, compat=compat):
            mixed_targets[compat] = valid.clone()
            return mixup(x_l, x_h, y_l, y_h, valid, lam)

        monkeypatch.setattr(fedlsm_client, "mixup", spy)
        images, labels = trainer.draw_batch()
        labels[trainer.pool_rows:] = -1
        trainer.compute_loss(images, labels)
    assert mixed_targets[False].all() and not mixed_targets[True].any()


@pytest.mark.parametrize("args, message", [
    ({"aggregation": "median"}, "aggregation must be one of"),
    ({"tau_neg": 0.9, "tau_pos": 0.8}, "below the positive ones"),
    ({"mix_batch": 0}, "mix_batch must be >= 1"),
    ({"strong_augment": "extreme"}, "strong_augment must be one of"),
])
def test_bad_options_fail_early(args: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FedLsmConfig(**args)


# ----- a fresh teacher every round, and the ablations of paper Table 3 ---------------------------------------


def test_every_round_starts_a_fresh_teacher_from_the_received_model() -> None:
    """The teacher of round r+1 is the model the site received (parameters and buffers), not last round's EMA."""
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8")
    trainer.train_round(RoundContext(0, 2))
    old_teacher = trainer.teacher
    with torch.no_grad():  # a new global model arrives: other weights and other BatchNorm statistics
        for tensor in trainer.model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.5)
    trainer.on_round_start(RoundContext(1, 2))
    assert trainer.teacher is not old_teacher and trainer.teacher.decay == trainer.cfg.ema_decay
    received, teacher = trainer.model.state_dict(), trainer.teacher.model.state_dict()
    for key, value in received.items():
        torch.testing.assert_close(teacher[key], value)
    assert trainer.q.sum() == 0  # q^k restarts with the round


def test_without_ude_batches_hold_only_pool_rows_and_the_loss_has_no_mixup_term(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8", ude=False)
    images, labels = trainer.draw_batch()
    assert trainer.pool_rows == trainer.train_cfg.batch_size == len(images) == len(labels)

    def no_lambda() -> float:
        raise AssertionError("w/o UDE draws no MixUp lambda")

    monkeypatch.setattr(trainer, "mixup_lambda", no_lambda)
    loss = trainer.compute_loss(images, labels)
    with torch.no_grad():
        probs = torch.softmax(trainer.teacher(images[:, 0]).float(), dim=1)
        targets = single_label_targets(labels, probs, trainer.cfg.tau, trainer.pseudo_classes)
        expected = soft_cross_entropy(trainer.model(images[:, 1]).float(), targets)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_without_ue_pools_are_random_and_every_sample_is_pseudo_labelled(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8", ue=False)

    def no_uncertainty() -> torch.Tensor:
        raise AssertionError("w/o UE scores no sample")

    monkeypatch.setattr(trainer, "uncertainty", no_uncertainty)
    draws = [trainer.pools() for _ in range(3)]
    n = len(trainer.data.train)
    for uncertain, confident, pseudo in draws:
        assert len(uncertain) == 4 and len(confident) == 6 and not set(uncertain) & set(confident)
        assert pseudo.tolist() == list(range(n))  # D^h is not taken out of the pseudo pool
    assert len({tuple(u) for u, _, _ in draws}) > 1  # drawn anew, not a fixed slice


# ----- invariants of the site update (ledger.toml): teacher, views, q, pos_weight, UDE partners and mask ---------


def test_after_each_student_step_the_teacher_moves_a_thousandth_of_the_way() -> None:
    """Spec §5(a)4-5: the teacher starts at the received model and, after the student's step, is
    0.999·teacher + 0.001·student (the default decay): ratio of the two displacements, fitted over every weight."""
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8")
    trainer.cfg.local_iterations = 1
    received = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_round(RoundContext(0, 2))
    student = torch.cat([(p.detach() - r).flatten() for p, r in zip(trainer.model.parameters(), received)]).double()
    teacher = torch.cat([(p - r).flatten() for p, r in zip(trainer.teacher.model.parameters(), received)]).double()
    assert student.abs().max() > 1e-4  # the student did move
    assert (teacher @ student / (student @ student)).item() == pytest.approx(0.001, rel=0.05)
    for mine, theirs in zip(trainer.teacher.model.buffers(), trainer.model.buffers()):
        torch.testing.assert_close(mine, theirs)  # BatchNorm statistics are copied


Forward = Callable[[torch.Tensor], torch.Tensor]


def plain_views(trainer: fedlsm_client.FedLsmTrainer) -> torch.Tensor:
    """Every training image, non-augmented and horizontally flipped: ``[2N, C, H, W]``."""
    plain = torch.stack([trainer.plain[i][0][0] for i in range(len(trainer.plain))])
    return torch.cat([plain, plain.flip(-1)])


def is_weak_view(rows: torch.Tensor, views: torch.Tensor) -> torch.Tensor:
    """bool per row: the row is one of ``views`` (an image, maybe flipped: all the weak augmentation does)."""
    distance = (rows[:, None] - views[None]).flatten(2).abs().amax(dim=2)
    return (distance < 1e-5).any(dim=1)


def test_the_teacher_labels_the_weak_view_and_the_student_learns_the_strong_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8")
    seen: dict[str, torch.Tensor] = {}
    teacher, student = trainer.teacher.model, trainer.model.forward

    def spy(name: str, model: Forward) -> Forward:
        def forward(x: torch.Tensor) -> torch.Tensor:
            seen[name] = x.detach().clone()
            return model(x)
        return forward

    monkeypatch.setattr(trainer.teacher, "model", spy("teacher", teacher))
    monkeypatch.setattr(trainer.model, "forward", spy("student", student))
    trainer.compute_loss(*trainer.draw_batch())
    rows, views = trainer.pool_rows, plain_views(trainer)
    assert is_weak_view(seen["teacher"][:rows], views).all()  # weak: the image, at most flipped
    assert not is_weak_view(seen["student"][:rows], views).any()  # strong: affine and colour jitter too


def test_multi_label_q_counts_known_and_pseudo_positives_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spec §5(a)5: q^k += GT positives + positive pseudo-labels; negatives (known or pseudo) are not counted."""
    trainer = fedlsm_trainer("synthetic:multilabel=1,classes=4,n=60,size=8")
    unknown = torch.nonzero(~trainer.identified).flatten()  # the site annotates 2 of the 4 classes
    logits = torch.zeros(4)
    logits[unknown[0]], logits[unknown[1]] = 20.0, -20.0  # one unknown class pseudo-positive, one pseudo-negative
    monkeypatch.setattr(trainer.teacher, "model", lambda x: logits.repeat(len(x), 1))
    images, labels = trainer.draw_batch()
    trainer.compute_loss(images, labels)
    pool = labels[: trainer.pool_rows]
    expected = (pool == 1).sum(dim=0) + ((pool < 0) & (logits > 0)).sum(dim=0)
    assert ((pool == 0).sum() > 0) and ((pool < 0) & (logits < 0)).sum() > 0  # there are negatives to leave out
    np.testing.assert_array_equal(trainer.q.numpy(), expected.numpy())


def bce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """mean over every element of weight · BCE, by hand."""
    p = torch.sigmoid(logits)
    return -(weights * (targets * torch.log(p) + (1 - targets) * torch.log(1 - p))).mean()


# D^h / D^l partner pairs of the multi-label case, 6 classes: class 0 known (1 at D^h, 0 at D^l), the others unknown
# with these teacher sigmoids. Default thresholds: D^h τ_lp 0.7 / τ_ln 0.01, D^l τ_p 0.85 / τ_n 0.005.
PARTNER_H = [0.5, 0.8, 0.008, 0.9, 0.9, 0.001]  # 1: positive only at τ_lp; 2: negative only at τ_ln
PARTNER_L = [0.5, 0.9, 0.001, 0.5, 0.8, 0.008]  # 3: uncertain; 4: positive only at τ_lp; 5: negative only at τ_ln
MIXED_VALID = [True, True, True, False, False, False]  # 3-5: one partner has no target (AND, not OR)


def test_multi_label_loss_by_hand_pos_weighted_plus_masked_mixup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spec §5(a)5 and §5(e)2 by hand: pool entries weighted by pos_weight (uncertain ones 0); MixUp partners
    labelled at τ_lp/τ_ln (D^h) and τ_p/τ_n (D^l); a mixed entry counts where both have one; + 0.1 × its BCE."""
    trainer = fedlsm_trainer("synthetic:multilabel=1,classes=6,n=60,size=8", partition="labelset:3")
    trainer.pos_weight = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    rows, mix = trainer.pool_rows, trainer.mix_rows
    images, labels = trainer.draw_batch()
    labels[rows:] = -1
    labels[rows:rows + mix, 0], labels[rows + mix:, 0] = 1, 0
    pool_probs = torch.tensor([0.99, 0.002, 0.5, 0.8, 0.008, 0.9])  # pool (τ_p/τ_n): 1, 0, -, -, -, 1
    probs = torch.cat([pool_probs.repeat(rows, 1), torch.tensor(PARTNER_H).repeat(mix, 1),
                       torch.tensor(PARTNER_L).repeat(mix, 1)])
    monkeypatch.setattr(trainer.teacher, "model", lambda x: torch.logit(probs))
    monkeypatch.setattr(trainer, "mixup_lambda", lambda: 0.3)
    trainer.model.eval()  # each row's logits independent of the rest of the batch
    loss = trainer.compute_loss(images, labels)

    pool = labels[:rows]
    targets = torch.where(pool >= 0, pool.float(), torch.tensor([1.0, 0, 0, 0, 0, 1]))
    valid = (pool >= 0) | torch.tensor([True, True, False, False, False, True])
    y_h, y_l = torch.tensor([1.0, 1, 0, 1, 1, 0]), torch.tensor([0.0, 1, 0, 0, 0, 0])
    mixed_y = (0.3 * y_l + 0.7 * y_h) * torch.tensor(MIXED_VALID)
    mixed_x = 0.3 * images[rows + mix:, 0] + 0.7 * images[rows:rows + mix, 0]
    with torch.no_grad():
        logits = trainer.model(torch.cat([images[:rows, 1], mixed_x]))
        expected = (bce(logits[:rows], targets, trainer.pos_weight * valid)
                    + 0.1 * bce(logits[rows:], mixed_y.repeat(mix, 1), torch.tensor(MIXED_VALID).float()))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def soft_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean over rows of −Σ_k t_k · log softmax(z)_k, by hand."""
    return -(targets * torch.log_softmax(logits, dim=1)).sum(dim=1).mean()


def one_hot_probs(klass: int, p: float, num_classes: int = 3) -> list[float]:
    """A teacher's softmax with ``p`` on ``klass`` and the rest spread evenly."""
    return [p if c == klass else (1 - p) / (num_classes - 1) for c in range(num_classes)]


def test_single_label_loss_by_hand_with_partners_at_tau_l_and_tau(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spec §5(a)5 and §5(e)1 by hand: soft CE over the pool + 0.1 × soft CE over the mixed rows, whose D^h
    partners are pseudo-labelled at τ_l (0.85) and D^l partners at τ (0.95); a pair counts only if both have one."""
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8")
    rows, mix = trainer.pool_rows, trainer.mix_rows
    u = int(torch.nonzero(trainer.pseudo_classes)[0])  # the class this site does not annotate
    a, b = [c for c in range(3) if c != u]
    images, labels = trainer.draw_batch()
    labels[rows:] = torch.tensor([a, -1, a, -1, b, a, -1, -1])  # D^h then D^l, pair i = rows i and i + 4
    partner_p = [0.0, 0.9, 0.0, 0.5, 0.0, 0.0, 0.9, 0.99]  # p(u) of the unlabelled partners
    pool_p = [0.99 if i % 2 else 0.9 for i in range(rows)]
    probs = torch.tensor([one_hot_probs(u, p) if p else [1 / 3] * 3 for p in pool_p + partner_p])
    monkeypatch.setattr(trainer.teacher, "model", lambda x: probs.log())
    monkeypatch.setattr(trainer, "mixup_lambda", lambda: 0.3)
    trainer.model.eval()
    loss = trainer.compute_loss(images, labels)

    eye, pool = torch.eye(3), labels[:rows]
    targets = torch.stack([eye[y] if y >= 0 else eye[u] * (p >= 0.95) for y, p in zip(pool.tolist(), pool_p)])
    y_h, y_l = eye[[a, u, a, u]], eye[[b, a, u, u]]  # pairs 1: D^h at τ_l; 2: D^l below τ; 3: D^h has none
    y_h[3] = y_l[2] = 0
    mixed_y = (0.3 * y_l + 0.7 * y_h) * torch.tensor([1.0, 1, 0, 0])[:, None]
    mixed_x = 0.3 * images[rows + mix:, 0] + 0.7 * images[rows:rows + mix, 0]
    with torch.no_grad():
        logits = trainer.model(torch.cat([images[:rows, 1], mixed_x]))
        expected = soft_ce(logits[:rows], targets) + 0.1 * soft_ce(logits[rows:], mixed_y)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


# ----- FedAvg*: the identified-class mask a site sends ------------------------------------------------------------


def test_fedavg_masked_sites_send_their_declared_classes_else_the_classes_they_label() -> None:
    """FedAvg* (spec §5(b)): the mask is the site's declared set; without one, the classes with a label (single-label)
    or with any known entry, a known 0 included (multi-label)."""
    declared = make_site_data(DataConfig(source="synthetic:n=60,classes=3,size=8", partition="labelset:2",
                                         num_sites=2), 0)
    trainer = FedAvgMaskedTrainer(tiny_net(3), declared, TrainConfig(batch_size=12), FedAvgMaskedConfig(),
                                  MASKED_SPEC.payload, torch.device("cpu"), log=lambda m: None)
    sent = trainer.round_meta(RoundContext(0, 2))["identified"]
    assert sent == declared.identified.astype(float).tolist() and sum(sent) == 2
    single = SimpleNamespace(identified=None, class_counts=np.array([5, 0, 2]), train=SimpleNamespace(labels=[0, 2]))
    np.testing.assert_array_equal(identified_classes(single), [True, False, True])
    multi = SimpleNamespace(train=SimpleNamespace(labels=np.array([[1, -1, 0], [0, -1, 0]])))
    np.testing.assert_array_equal(identified_classes(multi), [True, False, True])


def test_the_site_policys_floor_reports_a_small_class_as_one_the_site_has_none_of() -> None:
    """Issue 48, item 5: q (and the masked mode's class set) and the multi-label label counts."""
    trainer = fedlsm_trainer("synthetic:n=60,classes=3,size=8", aggregation="masked")
    trainer.q.copy_(torch.tensor([7.0, 2.0, 0.0], dtype=torch.float64))
    trainer.identified.fill_(True)
    trainer.min_class_samples = 3
    meta = trainer.round_meta(RoundContext(0, 2))
    assert meta["q"] == [7.0, 0.0, 0.0] and meta["identified"] == [1.0, 0.0, 1.0]
    multi = fedlsm_trainer("synthetic:multilabel=1,classes=4,n=60,size=8")
    labels = multi.data.train.labels
    multi.min_class_samples = int((labels == 1).sum(axis=0).max())  # every finding but the commonest is hidden
    arrays, _ = multi.run_phase(LABEL_COUNTS, {}, RoundContext(0, 2))
    kept = (labels == 1).sum(axis=0) >= multi.min_class_samples
    np.testing.assert_array_equal(arrays["positives"], np.where(kept, (labels == 1).sum(axis=0), 0))
    np.testing.assert_array_equal(arrays["positives"] + arrays["negatives"], len(labels))  # still one image set
    assert 0 < kept.sum() < 4


# ----- the paper's defaults (issue 51, item 3) --------------------------------------------------------------------
def test_defaults_are_the_papers_table_4() -> None:
    """spec §5(c), paper Table 4 where the configs differ (spec §5(e)3-4): τ 0.95; τ_l 0.85 (the ISIC config's 0.7
    is a preset); multi-label τ_p 0.85, τ_n 5e-3, τ_lp 0.7, τ_ln 1e-2 (the configs swap τ_n and τ_ln); λ_UDE 0.1,
    EMA 0.999, Beta α 0.2; 4 MixUp rows in a batch of 64; 30 local iterations (ISIC); AWPA with UDE and UE on;
    Adam lr 1e-4, β (0.9, 0.99) (paper; the configs' 0.9999 is a preset), weight decay 5e-4."""
    cfg = FedLsmConfig()
    assert (cfg.tau, cfg.tau_uncertain) == (0.95, 0.85)
    assert (cfg.tau_pos, cfg.tau_neg, cfg.tau_uncertain_pos, cfg.tau_uncertain_neg) == (0.85, 5e-3, 0.7, 1e-2)
    assert (cfg.lambda_ude, cfg.ema_decay, cfg.mixup_alpha, cfg.mix_batch) == (0.1, 0.999, 0.2, 4)
    assert (cfg.local_iterations, cfg.aggregation, cfg.ude, cfg.ue) == (30, "awpa", True, True)
    train = SPEC.train_defaults
    assert (train["optimizer"], train["lr"], tuple(train["betas"]), train["weight_decay"], train["batch_size"]) == (
        "adam", 1e-4, (0.9, 0.99), 5e-4, 64)
