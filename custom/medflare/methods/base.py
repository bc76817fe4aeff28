"""What every method is made of: a site-side LocalTrainer, a server-side ServerRule and a MethodSpec.

The trainer owns the one training loop all methods share (device, optimizer kept across rounds, AMP on
GPU, gradient clipping, abort checks, progress). A method overrides narrow hooks only. The server rule is
pure numpy: it turns accepted site updates into the next global model. Neither knows about FLARE.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from medflare import contracts
from medflare.contracts import Payload
from medflare.errors import ConfigError, PayloadError
from medflare.ops import load_params, model_params, normalise_weights, weighted_average

Log = Callable[[str], None]


@dataclass
class TrainConfig:
    """Local training settings shared by all methods (a method may change the defaults)."""

    optimizer: str = "adam"  # sgd | adam | adamw
    lr: float = 1e-3
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only
    weight_decay: float = 0.0
    batch_size: int = 64
    local_epochs: int = 1
    max_steps: int = 0  # cap on optimizer steps per round; 0 = no cap (use for quick CPU runs)
    grad_clip: float = 0.0  # max gradient norm; 0 = off
    lr_schedule: str = "constant"  # constant | cosine (once per round, as Fed-MAS does)
    min_lr: float = 1e-4  # cosine floor
    eval_batch_size: int = 256
    num_workers: int = 0
    torch_threads: int = 1  # CPU threads per site; keeps simulated sites from fighting over cores

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(f"train.optimizer must be sgd, adam or adamw, got '{self.optimizer}'")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"train.lr_schedule must be constant or cosine, got '{self.lr_schedule}'")
        if self.batch_size < 1 or self.local_epochs < 1:
            raise ConfigError("train.batch_size and train.local_epochs must be >= 1")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.max_steps < 0:
            raise ConfigError(f"train.max_steps must be >= 0 (0 = no cap), got {self.max_steps}")


@dataclass(frozen=True)
class RoundContext:
    """Where in the job a task sits (sent by the server with every task)."""

    round: int
    total_rounds: int
    stage: str = "train"
    server_meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class SiteUpdate:
    """One site's validated result, as the server rule sees it."""

    site: str
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


@dataclass
class AggregateResult:
    """The next global model and what the server wants recorded about this round."""

    params: dict[str, np.ndarray]
    shares: dict[str, float]  # site -> its share of the aggregate
    info: dict[str, Any] = field(default_factory=dict)  # e.g. {"rf": {site: value}}


def round_lr(cfg: TrainConfig, ctx: RoundContext) -> float:
    """Learning rate for this round: constant, or cosine over rounds without warm-up (Fed-MAS code)."""
    if cfg.lr_schedule == "constant" or ctx.total_rounds <= 0:
        return cfg.lr
    progress = (ctx.round + 1) / ctx.total_rounds
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class LocalTrainer:
    """Runs one site's local update. Methods subclass it and override hooks, never the loop.

    Batches without a single labelled sample are skipped unless ``uses_unlabelled_samples`` is true
    (semi-supervised and contrastive methods), so a supervised loss never averages over nothing.

    Args:
        model: the site's network (already on ``device``).
        data: the site's SiteData (train/val/test datasets, class counts).
        train_cfg: shared local-training settings.
        method_cfg: the method's own hyperparameters dataclass.
        payload: the method's wire declaration (decides which keys are loaded and sent).
        device: where to train.
        log: progress sink (the FLARE executor passes its logger).
    """

    uses_unlabelled_samples = False

    def __init__(
        self,
        model: nn.Module,
        data: Any,
        train_cfg: TrainConfig,
        method_cfg: Any,
        payload: Payload,
        device: torch.device,
        log: Log = print,
    ) -> None:
        self.model = model
        self.data = data
        self.train_cfg = train_cfg
        self.cfg = method_cfg
        self.payload = payload
        self.device = device
        self.log = log
        self.optimizer: torch.optim.Optimizer | None = None  # built once, kept across rounds
        self.use_amp = device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if self.use_amp else None
        self.class_counts = torch.as_tensor(np.asarray(data.class_counts), dtype=torch.float32, device=device)
        self.local_log: Callable[[dict[str, Any]], None] | None = None  # set by the site runtime

    def record_locally(self, **values: Any) -> None:
        """Keep per-site diagnostics (e.g. Fed-MAS's w and ŵ) in the site's own log; they are never sent."""
        if self.local_log is not None:
            self.local_log(values)

    # ----- lifecycle called by the FLARE executor -------------------------------------------------
    def receive(self, params: Mapping[str, np.ndarray]) -> None:
        """Load the received global arrays; private keys are never overwritten."""
        load_params(self.model, params, keep=lambda key: not self.payload.is_private(key))

    def outgoing_arrays(self) -> dict[str, np.ndarray]:
        """The arrays this site sends: its shared weights (methods sending other arrays override)."""
        if not self.payload.sends_weights:
            return {}
        return model_params(self.model, keep=lambda key: not self.payload.is_private(key))

    def train_round(self, ctx: RoundContext, should_abort: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Run E local epochs (or ``max_steps``) and return this round's meta."""
        start = time.perf_counter()
        self.on_round_start(ctx)
        optimizer = self._get_optimizer()
        for group in optimizer.param_groups:
            group["lr"] = round_lr(self.train_cfg, ctx)
        loss_sum, steps = 0.0, 0
        for epoch in range(self.train_cfg.local_epochs):
            self.model.train()
            epoch_loss, epoch_steps = self._train_epoch(optimizer, should_abort, steps)
            loss_sum, steps = loss_sum + epoch_loss, steps + epoch_steps
            self.log(
                f"round {ctx.round + 1}/{ctx.total_rounds} epoch {epoch + 1}/{self.train_cfg.local_epochs}: "
                f"loss {epoch_loss / max(epoch_steps, 1):.4f} over {epoch_steps} steps"
            )
            if self._step_cap_reached(steps) or should_abort():
                break
        meta = {
            contracts.N_SAMPLES: int(self.class_counts.sum().item()),
            contracts.TRAIN_LOSS: loss_sum / max(steps, 1),
            contracts.TRAIN_SECONDS: time.perf_counter() - start,
        }
        meta.update(self.round_meta(ctx))
        return meta

    def predictions(self, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels, class probabilities, per-sample cross-entropy) of the current model on ``split``.

        Rows keep the dataset's order (so they line up with per-sample attributes); label -1 rows have loss 0.
        """
        dataset = getattr(self.data, split)
        loader = DataLoader(dataset, batch_size=self.train_cfg.eval_batch_size, shuffle=False, num_workers=0)
        labels, probs, losses = [], [], []
        self.model.eval()
        with torch.no_grad():
            for images, batch_labels in loader:
                logits = self.predict_logits(images.to(self.device)).float()
                target = batch_labels.to(self.device)
                loss = F.cross_entropy(logits, target.clamp(min=0), reduction="none") * (target >= 0)
                labels.append(batch_labels.numpy())
                probs.append(torch.softmax(logits, dim=1).cpu().numpy())
                losses.append(loss.cpu().numpy())
        num_classes = int(self.data.num_classes)
        if not labels:
            return np.zeros(0, np.int64), np.zeros((0, num_classes)), np.zeros(0)
        return np.concatenate(labels), np.concatenate(probs), np.concatenate(losses)

    def evaluate(self, split: str) -> Any:
        """Summable evaluation statistics of the current model on ``split`` ('val' or 'test')."""
        return eval_stats(*self.predictions(split), num_classes=int(self.data.num_classes))

    # ----- hooks ----------------------------------------------------------------------------------
    def on_round_start(self, ctx: RoundContext) -> None:
        """Called after the global model is loaded and before training (e.g. snapshot global weights)."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The method's training loss for one batch. Unlabelled samples carry label -1 and are ignored."""
        return F.cross_entropy(self.model(images), labels, ignore_index=-1)

    def after_step(self) -> None:
        """Called after every optimizer step (e.g. an EMA teacher update)."""

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        """Method-specific meta to send (must be declared in the method's Payload)."""
        return {}

    def run_phase(
        self, phase: str, arrays: Mapping[str, np.ndarray], ctx: RoundContext
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Handle a method-specific task (a phase other than train/validate). Returns (arrays, meta)."""
        raise PayloadError(f"this method has no task '{phase}'; the server and site run different methods")

    def predict_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Logits used for evaluation (a personalized method may combine heads)."""
        return self.model(images)

    def parameters_to_train(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # ----- internals ------------------------------------------------------------------------------
    def _get_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.parameters_to_train(), self.train_cfg)
        return self.optimizer

    def _train_epoch(self, optimizer: torch.optim.Optimizer, should_abort: Callable[[], bool], done: int):
        loss_sum, steps = 0.0, 0
        for images, labels in self.train_loader():
            if self._step_cap_reached(done + steps) or should_abort():
                break
            if not self.uses_unlabelled_samples and not bool((labels >= 0).any()):
                continue  # nothing to learn from in this batch for a supervised loss
            images, labels = images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            loss = self._step(optimizer, images, labels)
            loss_sum, steps = loss_sum + loss, steps + 1
        return loss_sum, steps

    def _step(self, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=self.device.type, enabled=self.use_amp):
            loss = self.compute_loss(images, labels)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss.item()}; lower the learning rate")
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(optimizer)
            self._clip()
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self._clip()
            optimizer.step()
        self.after_step()
        return float(loss.detach().item())

    def _clip(self) -> None:
        if self.train_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.parameters_to_train(), self.train_cfg.grad_clip)

    def _step_cap_reached(self, steps: int) -> bool:
        return self.train_cfg.max_steps > 0 and steps >= self.train_cfg.max_steps

    def train_loader(self) -> DataLoader:
        """Shuffled training batches (drop_last only when it leaves at least one batch)."""
        dataset = self.data.train
        drop_last = len(dataset) > self.train_cfg.batch_size
        return DataLoader(
            dataset,
            batch_size=self.train_cfg.batch_size,
            shuffle=True,
            drop_last=drop_last,
            num_workers=self.train_cfg.num_workers,
            pin_memory=self.device.type == "cuda",
        )


def eval_stats(labels: np.ndarray, probs: np.ndarray, losses: np.ndarray, num_classes: int, keep=None) -> Any:
    """EvalStats of the labelled rows (optionally only rows where ``keep`` is true)."""
    from medflare.metrics import EvalStats

    rows = labels >= 0 if keep is None else (labels >= 0) & keep
    return EvalStats.from_predictions(labels[rows], probs[rows], num_classes, loss_sum=float(losses[rows].sum()))


def build_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer named in the config."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class ServerRule:
    """Server-side aggregation: sample-count-weighted average of every shared array (FedAvg).

    Subclasses change :meth:`site_weight` (e.g. RF), :meth:`row_weights` (per-class rows) or
    :meth:`aggregate` as a whole. Keys a site never sends (private keys) keep the server's value.
    """

    def __init__(self, method_cfg: Any, total_rounds: int) -> None:
        self.cfg = method_cfg
        self.total_rounds = total_rounds

    def stages(self) -> list[tuple[str, int]]:
        """(stage name, rounds) run in order; multi-stage methods (pre-train, then fine-tune) override."""
        return [("train", self.total_rounds)]

    def phases(self, ctx: RoundContext) -> list[str]:
        """Task names sent to the sites in one round, in order; the last phase's updates are aggregated.

        One phase ("train") by default. A logit-exchange method returns e.g. ["public_probs", "train"].
        """
        return ["train"]

    def phase_arrays(
        self, phase: str, global_params: Mapping[str, np.ndarray], earlier: Mapping[str, list[SiteUpdate]]
    ) -> dict[str, np.ndarray]:
        """Arrays the server sends with a phase's task (the global model by default).

        Args:
            phase: the task name about to be sent.
            global_params: the current global model.
            earlier: validated updates of this round's earlier phases, by phase.
        """
        return dict(global_params)

    def expected_arrays(
        self, phase: str, global_params: Mapping[str, np.ndarray], payload: Payload
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """key -> (shape, dtype) a valid site result carries in ``phase``: the global model's shared keys."""
        keys = payload.shared_keys(list(global_params))
        return {k: (np.shape(global_params[k]), np.asarray(global_params[k]).dtype) for k in keys}

    def server_meta(self, ctx: RoundContext) -> dict[str, Any]:
        """Extra meta sent to every site with the task."""
        return {}

    def site_weight(self, update: SiteUpdate, ctx: RoundContext) -> float:
        """A site's scalar aggregation weight: its labelled sample count."""
        return float(update.meta[contracts.N_SAMPLES])

    def row_weights(self, updates: list[SiteUpdate]) -> dict[str, dict[str, np.ndarray]] | None:
        """Optional key -> site -> per-row weights (row-wise classifier aggregation)."""
        return None

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        """What to record about this round besides the shares."""
        return {}

    def shares(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, float]:
        """Each site's share of the aggregate: its weight over the sum of weights."""
        return normalise_weights({u.site: self.site_weight(u, ctx) for u in updates})

    def aggregate(
        self, global_params: Mapping[str, np.ndarray], updates: list[SiteUpdate], ctx: RoundContext
    ) -> AggregateResult:
        """Combine accepted updates into the next global model."""
        shares = self.shares(updates, ctx)
        shared = weighted_average({u.site: u.arrays for u in updates}, shares, row_weights=self.row_weights(updates))
        params = {**dict(global_params), **shared}
        return AggregateResult(params=params, shares=shares, info=self.round_info(updates, ctx))


ModelBuilder = Callable[..., nn.Module]


def default_model_builder(
    model: str, num_classes: int, in_channels: int, image_size: int, pretrained: str | None, method_cfg: Any
) -> nn.Module:
    """The plain classifier from the model factory."""
    from medflare.models import create_model

    return create_model(model, num_classes, in_channels, pretrained=pretrained, image_size=image_size)


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: everything the CLI, the FLARE layer and the contract tests need.

    Attributes:
        name: registry key used on the command line (e.g. ``bsm-fl``).
        summary: one line for ``medflare methods``.
        config_cls: dataclass of the method's hyperparameters.
        trainer_cls: site-side LocalTrainer subclass.
        payload: what leaves a site.
        server_rule_cls: server-side aggregation rule.
        build_model: network builder (method-specific heads go here).
        train_defaults: TrainConfig overrides the method's paper uses.
        reference: paper or source the method follows.
        site_log_plot: optional picture of a site's local log records (simulation copies site logs out).
    """

    name: str
    summary: str
    config_cls: type
    trainer_cls: type[LocalTrainer]
    payload: Payload = Payload()
    server_rule_cls: type[ServerRule] = ServerRule
    build_model: ModelBuilder = default_model_builder
    train_defaults: Mapping[str, Any] = field(default_factory=dict)
    reference: str = ""
    site_log_plot: Callable[[list[dict[str, Any]], Any], Any] | None = None
