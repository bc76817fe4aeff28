"""medflare.optim: schedule values against the formulas, parameter groups, and when the optimizer is rebuilt."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from medflare.contracts import Payload
from medflare.errors import ConfigError
from medflare.methods.base import LocalTrainer, RoundContext, TrainConfig
from medflare.models import create_model
from medflare.models.vit import build_vit
from medflare.optim import build_optimizer, lr_at, param_groups, rebuild_due, set_step_lr


def _site(n: int = 16, features: int = 4, num_classes: int = 2) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    y = torch.arange(n) % num_classes
    dataset = TensorDataset(x, y)
    counts = np.bincount(y.numpy(), minlength=num_classes)
    return SimpleNamespace(train=dataset, val=dataset, test=dataset, num_classes=num_classes, class_counts=counts)


def _trainer(**train) -> LocalTrainer:
    torch.manual_seed(0)
    cfg = TrainConfig(**{"optimizer": "sgd", "momentum": 0.0, "lr": 0.1, "batch_size": 4, **train})
    return LocalTrainer(torch.nn.Linear(4, 2), _site(), cfg, None, Payload(), torch.device("cpu"), log=lambda m: None)


def _record_each_step(trainer: LocalTrainer) -> tuple[list[float], list[torch.optim.Optimizer]]:
    """Per optimizer step: the lr of the first group and the optimizer object that took the step."""
    lrs: list[float] = []
    optimizers: list[torch.optim.Optimizer] = []

    def record() -> None:
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        optimizers.append(trainer.optimizer)

    trainer.after_step = record
    return lrs, optimizers


# ----- schedule values: hand-computed from the formulas in medflare.optim's docstring -----------------------------
# warmup_cosine, lr 1e-3, min_lr 1e-5, 2 warm-up rounds, 10 rounds:
#   warm-up: 1e-3 * t / 2;  then 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + cos(pi * (t - 2) / 8))
WARMUP_COSINE = [
    (0.0, 0.0),  # warm-up starts from 0
    (0.5, 2.5e-4),
    (1.0, 5.0e-4),
    (2.0, 1.0e-3),  # peak at the end of warm-up
    (4.0, 1e-5 + 0.495e-3 * (1 + 0.7071067811865476)),  # a quarter of the cosine: cos(pi/4)
    (6.0, 5.05e-4),  # cosine midpoint: (lr + min_lr) / 2
    (10.0, 1e-5),  # end of the stage: the floor
]


@pytest.mark.parametrize(("t", "expected"), WARMUP_COSINE)
def test_warmup_cosine_values(t: float, expected: float) -> None:
    cfg = TrainConfig(lr=1e-3, min_lr=1e-5, lr_schedule="warmup_cosine", warmup_rounds=2)
    assert lr_at(cfg, t, stage_rounds=10) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("t", "expected"), [(0, 1e-3), (59.9, 1e-3), (60, 1e-4), (69.5, 1e-4), (70, 1e-5), (79, 1e-5)])
def test_multistep_drops_by_gamma_at_each_milestone(t: float, expected: float) -> None:
    """FCA's schedule: lr x 0.1 from round 60 and again from round 70."""
    cfg = TrainConfig(lr=1e-3, lr_schedule="multistep", milestones=[60, 70], gamma=0.1)
    assert lr_at(cfg, t, stage_rounds=80) == pytest.approx(expected, rel=1e-12)


def test_round_cosine_is_constant_within_a_round_and_ends_at_the_floor() -> None:
    """Fed-MAS's cosine: one value per round, 1e-4 + 0.5 (0.1 - 1e-4)(1 + cos(pi (r+1)/10))."""
    cfg = TrainConfig(lr=0.1, min_lr=1e-4, lr_schedule="cosine")
    first = 1e-4 + 0.5 * (0.1 - 1e-4) * (1 + 0.9510565162951535)  # cos(pi/10)
    assert lr_at(cfg, 0.0, 10) == lr_at(cfg, 0.99, 10) == pytest.approx(first, rel=1e-12)
    assert lr_at(cfg, 9.5, 10) == pytest.approx(1e-4, rel=1e-12)


def test_constant_schedule_ignores_position() -> None:
    cfg = TrainConfig(lr=0.01)
    assert {lr_at(cfg, t, 5) for t in (0.0, 2.5, 4.9)} == {0.01}


def test_trainer_sets_the_lr_per_step_by_fractional_position() -> None:
    """4 steps per round: round 0 is warm-up at t = 0, .25, .5, .75; round 1 is cosine at t = 1 .. 1.75."""
    # Prepare: 16 samples, batch 4 -> 4 steps; lr 0.1, min_lr 0, 1 warm-up round, 3 rounds
    trainer = _trainer(lr_schedule="warmup_cosine", warmup_rounds=1, min_lr=0.0)
    lrs, _ = _record_each_step(trainer)

    # Execute
    trainer.train_round(RoundContext(0, 3))
    trainer.train_round(RoundContext(1, 3))

    # Assert: cosine part is 0.05 (1 + cos(pi (t - 1) / 2))
    cosines = [1.0, 0.9238795325112867, 0.7071067811865476, 0.3826834323650898]  # cos(0, pi/8, pi/4, 3pi/8)
    expected = [0.0, 0.025, 0.05, 0.075] + [0.05 * (1 + c) for c in cosines]
    np.testing.assert_allclose(lrs, expected, rtol=1e-12, atol=1e-15)


def test_local_epochs_share_one_pass_over_the_round() -> None:
    """With 2 local epochs of 2 steps, t still advances by 1/4 per step (no repeat of the curve per epoch)."""
    trainer = _trainer(lr_schedule="warmup_cosine", warmup_rounds=1, min_lr=0.0, batch_size=8, local_epochs=2)
    lrs, _ = _record_each_step(trainer)
    trainer.train_round(RoundContext(0, 3))
    np.testing.assert_allclose(lrs, [0.0, 0.025, 0.05, 0.075], rtol=1e-12, atol=1e-15)


def test_group_lr_is_scheduled_lr_times_lr_scale() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    cfg = TrainConfig(lr=1e-3, lr_schedule="warmup_cosine", warmup_rounds=4, min_lr=0.0)
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr_scale": 0.5},
                                 {"params": model[1].parameters()}], lr=1.0)
    lr = set_step_lr(optimizer, cfg, stage_round=1, stage_rounds=10, step_in_round=5, steps_per_round=10)
    assert lr == pytest.approx(1e-3 * 1.5 / 4)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr * 0.5, lr])


# ----- parameter groups ---------------------------------------------------------------------------------------------
def test_default_is_one_group_decaying_everything() -> None:
    model = create_model("cnn", 3)
    groups = param_groups(model, TrainConfig(weight_decay=5e-4))
    assert len(groups) == 1 and groups[0]["weight_decay"] == 5e-4
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in model.parameters()}


def test_the_default_groups_need_no_timm_and_the_decay_rules_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """timm costs a site process 0.7 s to import; the default optimizer does without it."""
    monkeypatch.setitem(sys.modules, "timm.optim", None)  # importing it now raises ImportError
    model = create_model("cnn", 3)
    assert len(param_groups(model, TrainConfig(weight_decay=5e-4))) == 1
    with pytest.raises(ImportError):
        param_groups(model, TrainConfig(weight_decay=0.05, no_decay_norm_bias=True))


def test_no_decay_group_holds_exactly_the_one_dimensional_params() -> None:
    model = create_model("cnn", 3)
    groups = param_groups(model, TrainConfig(weight_decay=0.05, no_decay_norm_bias=True))
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    assert set(by_decay) == {0.0, 0.05}
    assert by_decay[0.0] == {id(p) for p in model.parameters() if p.ndim <= 1}
    assert by_decay[0.05] == {id(p) for p in model.parameters() if p.ndim > 1}


def test_vit_position_embedding_and_class_token_take_no_decay() -> None:
    model = build_vit("tiny", num_classes=3, in_channels=1, image_size=28)
    groups = param_groups(model, TrainConfig(weight_decay=0.05, no_decay_norm_bias=True))
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert id(model.backbone.pos_embed) in no_decay and id(model.backbone.cls_token) in no_decay
    assert id(model.backbone.patch_embed.proj.weight) not in no_decay


def test_layer_decay_scales_each_vit_block() -> None:
    """0.65 ** (L + 1 - layer): stem at layer 0, block i at layer i + 1, fc_norm and head at L + 1 (L = 12)."""
    model = build_vit("tiny", num_classes=3, in_channels=1, image_size=28)
    groups = param_groups(model, TrainConfig(weight_decay=0.05, layer_decay=0.65))
    scale_of = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    depth = len(model.backbone.blocks)
    for name, param in model.named_parameters():
        if name.startswith(("backbone.patch_embed", "backbone.pos_embed", "backbone.cls_token")):
            layer = 0
        elif name.startswith("backbone.blocks."):
            layer = int(name.split(".")[2]) + 1
        else:
            assert name.startswith(("backbone.fc_norm", "head.")), name
            layer = depth + 1
        assert scale_of[id(param)] == pytest.approx(0.65 ** (depth + 1 - layer)), name


def test_layer_decay_needs_a_model_that_declares_layers() -> None:
    with pytest.raises(ConfigError, match="layer_decay"):
        param_groups(create_model("cnn", 3), TrainConfig(layer_decay=0.65))


def test_only_trainable_params_are_optimized_and_extra_ones_get_a_group() -> None:
    model = torch.nn.Linear(3, 2)
    extra = torch.nn.Parameter(torch.zeros(4))
    optimizer = build_optimizer(model, TrainConfig(), trainable=[model.weight, extra])
    optimized = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(optimized) == sorted([id(model.weight), id(extra)])


def test_adam_betas_and_eps_reach_the_optimizer() -> None:
    optimizer = build_optimizer(torch.nn.Linear(2, 2), TrainConfig(optimizer="adamw", betas=[0.9, 0.95], eps=1e-6))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["eps"] == 1e-6


# ----- fresh optimizer ------------------------------------------------------------------------------------------
def test_fresh_optimizer_step_rebuilds_before_every_step() -> None:
    """MDH-FL's fresh Adam per step: a new object each step, whose moments hold exactly one step."""
    trainer = _trainer(optimizer="adam", fresh_optimizer="step")
    _, optimizers = _record_each_step(trainer)
    trainer.train_round(RoundContext(0, 2))
    assert len(optimizers) == 4 and len({id(o) for o in optimizers}) == 4
    assert all(int(state["step"]) == 1 for o in optimizers for state in o.state.values())


@pytest.mark.parametrize(("fresh", "distinct"), [("never", 1), ("stage", 2), ("round", 3)])
def test_fresh_optimizer_rebuilds_per_stage_or_round(fresh: str, distinct: int) -> None:
    """Rounds 0, 1 of stage 'pretrain' then round 2 of 'finetune': 1, 2 or 3 optimizers."""
    trainer = _trainer(optimizer="adam", fresh_optimizer=fresh)
    _, optimizers = _record_each_step(trainer)
    for ctx in (RoundContext(0, 3, "pretrain"), RoundContext(1, 3, "pretrain"), RoundContext(2, 3, "finetune")):
        trainer.train_round(ctx)
    assert len({id(o) for o in optimizers}) == distinct


def test_rebuild_due_compares_the_named_level() -> None:
    assert rebuild_due("never", None, ("a", 0, 0))
    assert not rebuild_due("never", ("a", 0, 0), ("b", 5, 3))
    assert rebuild_due("stage", ("a", 0, 0), ("b", 1, 0)) and not rebuild_due("stage", ("a", 0, 0), ("a", 1, 0))
    assert rebuild_due("round", ("a", 0, 3), ("a", 1, 0)) and not rebuild_due("round", ("a", 1, 0), ("a", 1, 1))
    assert rebuild_due("step", ("a", 1, 0), ("a", 1, 1))


# ----- config validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("option", "value"), [
    ("lr_schedule", "linear"),
    ("fresh_optimizer", "sometimes"),
    ("betas", (0.9,)),
    ("betas", (0.9, 1.5)),
    ("eps", 0.0),
    ("layer_decay", 0.0),
    ("layer_decay", 1.5),
    ("warmup_rounds", -1.0),
    ("milestones", (70, 60)),
    ("gamma", 0.0),
])
def test_bad_training_options_name_the_option(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"train.{option}"):
        TrainConfig(**{option: value})


# ----- per-stage settings and the lr scaling rule -----------------------------------------------------------------
def test_base_batch_scales_the_peak_lr_with_the_batch_but_not_the_floor() -> None:
    """MAE's rule: absolute lr = blr x batch / 256; min_lr stays absolute."""
    cfg = TrainConfig(lr=2e-3, base_batch=256, batch_size=64, lr_schedule="warmup_cosine", warmup_rounds=1, min_lr=1e-6)
    assert lr_at(cfg, 1.0, 3) == pytest.approx(5e-4, rel=1e-12)
    assert lr_at(cfg, 3.0, 3) == pytest.approx(1e-6, rel=1e-12)
    assert lr_at(TrainConfig(lr=2e-3, batch_size=64), 0.0, 3) == 2e-3  # base_batch 0: lr as given


def test_stage_overrides_apply_in_their_stage_only() -> None:
    cfg = TrainConfig(lr=1e-3, betas=(0.9, 0.999), stages={"pretrain": {"lr": 5e-4, "betas": [0.9, 0.95]}})
    pretrain, finetune = cfg.for_stage("pretrain"), cfg.for_stage("finetune")
    assert (pretrain.lr, pretrain.betas, pretrain.stages) == (5e-4, (0.9, 0.95), {})
    assert finetune is cfg and cfg.for_stage(None) is cfg
    with pytest.raises(ConfigError, match="train.stages.pretrain: unknown option"):
        TrainConfig(stages={"pretrain": {"learning_rate": 1.0}})
    with pytest.raises(ConfigError, match="train.stages.pretrain.*must map"):
        TrainConfig(stages={"pretrain": {"stages": {}}})


def test_trainer_trains_each_stage_with_its_settings() -> None:
    trainer = _trainer(optimizer="adam", fresh_optimizer="stage", stages={"warmup": {"lr": 0.5, "betas": [0.5, 0.9]}})
    lrs, optimizers = _record_each_step(trainer)
    trainer.train_round(RoundContext(0, 2, "warmup"))
    trainer.train_round(RoundContext(1, 2, "main"))
    assert lrs == [0.5] * 4 + [0.1] * 4
    assert optimizers[0].defaults["betas"] == (0.5, 0.9) and optimizers[-1].defaults["betas"] == (0.9, 0.999)
