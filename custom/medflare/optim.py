"""Local training settings, optimizers (:func:`build_optimizer`) and learning-rate schedules (:func:`set_step_lr`
before every step) of every method; schedules are pure functions of the position ``t`` in the stage (:func:`lr_at`).

Schedules (``TrainConfig.lr_schedule``), with ``t = stage_round + step_in_round / steps_per_round``:
    constant        ``lr``
    cosine          once per round, no warm-up (Fed-MAS): ``min_lr + (lr - min_lr)/2 * (1 + cos(pi*(r+1)/R))``
                    with ``r = floor(t)`` and ``R`` the rounds of the stage
    warmup_cosine   per step (MAE/BEiT, spec §4(a)): ``lr * t / W`` while ``t < W`` (``W = warmup_rounds``), then
                    ``min_lr + (lr - min_lr)/2 * (1 + cos(pi * (t - W) / (R - W)))``
    multistep       ``lr * gamma ** (number of milestones <= floor(t))`` (FCA: milestones 60 and 70, gamma 0.1)

Here ``lr`` is the peak lr: ``train.lr``, or ``train.lr * batch_size / base_batch`` when ``base_batch > 0`` (MAE's
scaling rule, base 256); ``min_lr`` is absolute. A parameter group's ``lr_scale`` (layer-wise decay) multiplies
the scheduled lr.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping

import torch
from torch import nn

from medflare.config import MAX_ROUNDS, bounded, check_fields, fields_typed
from medflare.errors import ConfigError

__all__ = [
    "FRESH_OPTIMIZER",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OptimizerKey",
    "TrainConfig",
    "build_optimizer",
    "check_train_options",
    "lr_at",
    "param_groups",
    "peak_lr",
    "rebuild_due",
    "set_step_lr",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine", "warmup_cosine", "multistep")
FRESH_OPTIMIZER = ("never", "stage", "round", "step")
# Bounds of a site's training numbers: beyond them a setting is a typo or an attack on the site's machine
MAX_BATCH = 65_536
MAX_LOCAL_EPOCHS = 10_000
MAX_WORKERS = 64  # data-loader processes
MAX_THREADS = 1_024  # torch CPU threads

#: Where a step sits: (stage name, round, step in round); compared by :func:`rebuild_due`.
OptimizerKey = tuple[str, int, int]


@dataclass
class TrainConfig:
    """Local training settings shared by all methods (a method may change the defaults); the functions below give
    the optimizer and schedule options their meaning."""

    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = bounded(1e-3, low=0, low_open=True)
    momentum: float = bounded(0.9, low=0, high=1, high_open=True)  # sgd only
    nesterov: bool = False  # sgd only
    betas: tuple[float, float] = bounded((0.9, 0.999), low=0, high=1, high_open=True)  # adam/adamw only (MAE pre-training uses (0.9, 0.95))
    eps: float = bounded(1e-8, low=0, high=1, low_open=True)  # adam/adamw only
    weight_decay: float = bounded(0.0, low=0, high=10)
    no_decay_norm_bias: bool = False  # no weight decay on 1-D params (norms, biases) and e.g. a ViT's pos_embed
    layer_decay: float = bounded(1.0, low=0, high=1, low_open=True, words="in (0, 1] (1 = off)")  # layer-wise lr decay for vit_* models (BEiT/MAE fine-tuning use 0.65); 1 = off
    batch_size: int = bounded(64, low=1, high=MAX_BATCH)
    local_epochs: int = bounded(1, low=1, high=MAX_LOCAL_EPOCHS)
    max_steps: int = bounded(0, low=0, high=10**9, zero="no cap")  # cap on optimizer steps per round; 0 = no cap (use for quick CPU runs)
    grad_clip: float = bounded(0.0, low=0, zero="off")  # max gradient norm; 0 = off
    # constant | cosine (once per round, as Fed-MAS does) | warmup_cosine (per step, MAE/BEiT) | multistep (FCA)
    lr_schedule: Literal["constant", "cosine", "warmup_cosine", "multistep"] = "constant"
    min_lr: float = bounded(1e-4, low=0)  # cosine floor (cosine, warmup_cosine)
    warmup_rounds: float = bounded(0.0, low=0, high=MAX_ROUNDS)  # warmup_cosine: linear warm-up from 0 over this many rounds of the stage
    milestones: tuple[int, ...] = bounded((), low=0, high=MAX_ROUNDS, items=MAX_ROUNDS)  # multistep: stage rounds at which lr is multiplied by gamma
    gamma: float = bounded(0.1, low=0, low_open=True)  # multistep factor
    # never: state kept across rounds | stage: new at a stage change | round | step (MDH-FL's fresh Adam per step)
    fresh_optimizer: Literal["never", "stage", "round", "step"] = "never"
    eval_batch_size: int = bounded(256, low=1, high=MAX_BATCH)
    num_workers: int = bounded(0, low=0, high=MAX_WORKERS)  # data-loader processes per site
    torch_threads: int = bounded(1, low=1, high=MAX_THREADS)  # CPU threads per site; keeps simulated sites from fighting over cores
    base_batch: int = bounded(0, low=0, high=MAX_BATCH, zero="lr as given")  # > 0: lr is given per base_batch images and scales with batch_size (MAE: 256); 0 = as given
    # stage name -> overrides of the options above in that stage (SSL-FL pre-trains and fine-tunes differently)
    stages: dict[str, dict[str, Any]] = bounded({}, checked_by="the method's stage names; values as train.*")

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # JSON/TOML give lists
        self.milestones = tuple(self.milestones)
        check_fields(self, "train")  # the bounds of each option (Bound, in the field's metadata)
        check_train_options(self)
        # each stage's overrides typed once, here, so a stage's settings are checked before any round needs them
        self.stages = {stage: self._typed_stage(stage, overrides) for stage, overrides in self.stages.items()}
        for stage in self.stages:
            self.for_stage(stage)  # the ranges of each stage's settings

    def for_stage(self, stage: str | None) -> TrainConfig:
        """The settings in ``stage``: these options with ``stages[stage]`` on top (ConfigError for a non-option)."""
        overrides = self.stages.get(stage or "")
        return replace(self, stages={}, **overrides) if overrides else self

    @staticmethod
    def _typed_stage(stage: str, overrides: Any) -> dict[str, Any]:
        if not isinstance(overrides, Mapping) or "stages" in overrides:
            raise ConfigError(f"train.stages.{stage} must map TrainConfig options to values, got {overrides!r}")
        return fields_typed(TrainConfig, dict(overrides), f"train.stages.{stage}")


def check_train_options(cfg: TrainConfig) -> None:
    """ConfigError naming the ``train.*`` option, its value and what is allowed, for a setting that cannot work."""
    choices = (("optimizer", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES), ("fresh_optimizer", FRESH_OPTIMIZER))
    for name, allowed in choices:
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"train.{name} must be one of {', '.join(allowed)}, got '{getattr(cfg, name)}'")
    if len(cfg.betas) != 2:
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {cfg.betas!r}")
    if list(cfg.milestones) != sorted(set(cfg.milestones)):
        raise ConfigError(f"train.milestones must be increasing round numbers >= 0, got {cfg.milestones!r}")


def lr_at(cfg: TrainConfig, t: float, stage_rounds: int) -> float:
    """The scheduled (unscaled) lr at ``t = stage_round + step_in_round / steps_per_round`` of a stage."""
    peak = peak_lr(cfg)
    if cfg.lr_schedule == "constant" or stage_rounds <= 0:
        return peak
    if cfg.lr_schedule == "multistep":
        return peak * cfg.gamma ** bisect.bisect_right(list(cfg.milestones), math.floor(t))
    if cfg.lr_schedule == "cosine":
        return _half_cosine(peak, cfg.min_lr, (math.floor(t) + 1) / stage_rounds)
    warmup = cfg.warmup_rounds
    if t < warmup:
        return peak * t / warmup
    return _half_cosine(peak, cfg.min_lr, (t - warmup) / (stage_rounds - warmup))


def peak_lr(cfg: TrainConfig) -> float:
    """``lr``, scaled by ``batch_size / base_batch`` when ``base_batch > 0`` (MAE: absolute lr = blr x batch / 256)."""
    return cfg.lr * cfg.batch_size / cfg.base_batch if cfg.base_batch > 0 else cfg.lr


def _half_cosine(peak: float, floor: float, progress: float) -> float:
    """From ``peak`` at progress 0 down to ``floor`` at progress 1 (clamped to [0, 1])."""
    progress = min(max(progress, 0.0), 1.0)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def set_step_lr(
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    stage_round: int,
    stage_rounds: int,
    step_in_round: int,
    steps_per_round: int,
) -> float:
    """Set every group's lr for one optimizer step (0-based ``step_in_round``, across local epochs): the scheduled
    lr times the group's ``lr_scale``; returns the unscaled scheduled lr."""
    lr = lr_at(cfg, stage_round + step_in_round / max(steps_per_round, 1), stage_rounds)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def rebuild_due(fresh_optimizer: str, previous: OptimizerKey | None, current: OptimizerKey) -> bool:
    """Whether to build a new optimizer (dropping its state) before the step at ``current``, given the step the
    current one last served (``previous``, None at first) and ``fresh_optimizer`` (see :class:`TrainConfig`)."""
    if previous is None:
        return True
    changed_upto = {"never": 0, "stage": 1, "round": 2, "step": 3}[fresh_optimizer]
    return previous[:changed_upto] != current[:changed_upto]


def param_groups(model: nn.Module, cfg: TrainConfig, trainable: Iterable[nn.Parameter] | None = None) -> list[dict]:
    """Parameter groups, each with ``weight_decay`` and ``lr_scale``; one group by default.

    ``no_decay_norm_bias`` moves 1-D tensors and the model's ``no_weight_decay()`` names (a ViT's ``pos_embed``)
    to a group without weight decay; ``layer_decay < 1`` gives layer ``i`` of ``L + 2`` the lr scale
    ``layer_decay ** (L + 1 - i)`` (timm, BEiT/MAE fine-tuning; needs timm's ``group_matcher``, as ``vit_*``).
    ``trainable`` defaults to the parameters that require grad; those not in ``model`` get a group of their own.

    Raises:
        ConfigError: ``layer_decay < 1`` on a model without ``group_matcher``.
    """
    wanted = list(trainable) if trainable is not None else [p for p in model.parameters() if p.requires_grad]
    if cfg.layer_decay == 1.0 and not cfg.no_decay_norm_bias:  # the default: one group, and no timm import (0.7 s)
        return _restrict([{"params": list(model.parameters()), "weight_decay": cfg.weight_decay}], wanted,
                         cfg.weight_decay)
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay  # here: timm is slow to import

    if cfg.layer_decay < 1.0:
        if not hasattr(model, "group_matcher"):
            raise ConfigError(
                f"train.layer_decay={cfg.layer_decay} needs a model that declares its layers (a vit_* model); "
                f"{type(model).__name__} does not; set train.layer_decay=1.0"
            )
        groups = param_groups_layer_decay(
            model,
            weight_decay=cfg.weight_decay,
            layer_decay=cfg.layer_decay,
            no_weight_decay_list=_no_weight_decay_names(model, cfg),
            weight_decay_exclude_1d=cfg.no_decay_norm_bias,
        )
    else:
        groups = param_groups_weight_decay(
            model, weight_decay=cfg.weight_decay, no_weight_decay_list=_no_weight_decay_names(model, cfg)
        )
    return _restrict(groups, wanted, cfg.weight_decay)


def _no_weight_decay_names(model: nn.Module, cfg: TrainConfig) -> set[str]:
    declared = getattr(model, "no_weight_decay", None)
    return set(declared()) if cfg.no_decay_norm_bias and callable(declared) else set()


def _restrict(groups: list[dict], wanted: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Keep only ``wanted`` parameters in the groups; wanted parameters found in no group get their own."""
    wanted_ids = {id(p) for p in wanted}
    kept, grouped = [], set()
    for group in groups:
        params = [p for p in group["params"] if id(p) in wanted_ids]
        grouped.update(id(p) for p in params)
        if params:
            kept.append({**group, "params": params, "lr_scale": group.get("lr_scale", 1.0)})
    outside = [p for p in wanted if id(p) not in grouped]
    if outside:
        kept.append({"params": outside, "weight_decay": weight_decay, "lr_scale": 1.0})
    return kept


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, trainable: Iterable[nn.Parameter] | None = None
) -> torch.optim.Optimizer:
    """The optimizer named in ``cfg`` over :func:`param_groups` (group lr is set per step by :func:`set_step_lr`).

    torch builds the optimizer itself (timm's factory would turn ``sgd`` into Nesterov SGD); betas and eps
    apply to Adam and AdamW, momentum and nesterov to SGD. Adam's weight decay is an L2 term, AdamW's decoupled.
    """
    groups = param_groups(model, cfg, trainable)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
        )
    adam = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
