"""What every method is made of: a site-side LocalTrainer, a server-side ServerRule and a MethodSpec. The trainer owns
the one training loop all methods share (device, optimizer kept across rounds, AMP on GPU, gradient clipping, abort
checks, progress). A method overrides narrow hooks only. The server rule is pure numpy: it turns accepted site updates
into the next global model. Neither knows about FLARE."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from medflare import contracts
from medflare.contracts import ContractContext, Payload
from medflare.errors import ConfigError, PayloadError
from medflare.losses.multi_label import masked_bce
from medflare.methods.presets import Preset
from medflare.ops import load_params, model_params
from medflare.ops.influence import Mixture, Weighting, bound, combine
from medflare.optim import OptimizerKey, TrainConfig, build_optimizer, lr_at, rebuild_due, set_step_lr

if TYPE_CHECKING:
    from medflare.dp_sgd import PrivateTraining

Log = Callable[[str], None]
LARGEST_SHARE = "largest_share"  # a round's record: site -> its largest share of any row of a row-weighted array


@dataclass(frozen=True)
class Stage:
    """One stage of a job: a named run of consecutive rounds (e.g. "pretrain", then "finetune")."""

    name: str  # travels with every task (RoundContext.stage)
    rounds: int  # a rule's stages add up to the job's rounds
    scored: bool = True  # sites score the global model and the best one is kept (pre-training has no classifier)


@dataclass(frozen=True)
class RoundContext:
    """Where in the job a task sits (sent by the server with every task). ``stage_round`` / ``stage_rounds`` index the
    round inside the current stage (default: the job's counters), so per-stage schedules restart with each stage."""

    round: int
    total_rounds: int
    stage: str = "train"
    server_meta: Mapping[str, Any] = field(default_factory=dict)
    stage_round: int = -1
    stage_rounds: int = 0
    scored: bool = True

    def __post_init__(self) -> None:
        if self.stage_round < 0:
            object.__setattr__(self, "stage_round", self.round)
        if self.stage_rounds <= 0:
            object.__setattr__(self, "stage_rounds", self.total_rounds)


def round_lr(cfg: TrainConfig, ctx: RoundContext) -> float:
    """The learning rate at the first step of the round ``ctx`` describes (schedules restart with each stage)."""
    return lr_at(cfg, float(ctx.stage_round), ctx.stage_rounds)


@dataclass
class PerSite:
    """Arrays the server sends to each site separately in one phase; a site not listed gets no task."""

    arrays: dict[str, dict[str, np.ndarray]]


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


class LocalTrainer:
    """Runs one site's local update (the site's network on ``device``, its SiteData, the job's TrainConfig, the method's
    config and Payload, a progress sink). Methods subclass it and override hooks, never the loop. Batches without a
    single labelled sample are skipped unless ``uses_unlabelled_samples`` is true (semi-supervised and contrastive
    methods), so a supervised loss never averages over nothing. Single- and multi-label tasks share the loop; the data
    decides (``multi_label``). Multi-label labels are ``[B, K]`` rows of 1/0/-1 (unknown); prediction is a sigmoid per
    class and the default loss a BCE over the known entries (``MethodSpec.multi_label``)."""

    uses_unlabelled_samples = False
    # the site policy's floor (SiteSettings.min_class_samples): statistics about a smaller class never leave
    min_class_samples = 0

    def __init__(self, model: nn.Module, data: Any, train_cfg: TrainConfig, method_cfg: Any, payload: Payload,
                 device: torch.device, log: Log = print) -> None:
        self.model, self.data, self.cfg, self.payload, self.device, self.log = model, data, method_cfg, payload, device, log
        self.job_train_cfg = train_cfg  # the job's settings, with their per-stage overrides
        self.train_cfg = train_cfg  # the settings of the current stage
        self.optimizer: torch.optim.Optimizer | None = None  # kept across rounds unless train.fresh_optimizer
        self._optimizer_key: OptimizerKey | None = None  # (stage, round, step) the optimizer last served
        self._round_ctx = RoundContext(0, 1)  # the round being trained and its planned optimizer steps
        self._round_steps = 1
        self.use_amp = device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if self.use_amp else None
        self.class_counts = torch.as_tensor(np.asarray(data.class_counts), dtype=torch.float32, device=device)
        self.local_log: Callable[[dict[str, Any]], None] | None = None  # set by the site runtime
        # (job-wide epoch index, mean loss) after each local epoch; the FLARE executor streams it when tracking
        self.epoch_listener: Callable[[int, float], None] | None = None
        self.received: dict[str, np.ndarray] = {}  # declared non-parameter arrays of the current task
        self._stage: str | None = None  # the stage of the last round trained (kept across restarts)
        self._configured_stage: str | None = None  # the stage on_stage_start last ran for (this process)
        self.dp: PrivateTraining | None = None  # DP-SGD (the site runtime enables it when the job asks)

    def enable_dp_sgd(self, dp: PrivateTraining) -> None:
        """Train with DP-SGD from now on: Poisson batches, per-sample clipping and noise, every step accounted. AMP
        is off (Opacus's per-sample gradients and the loss scaler do not mix); each sample's gradient is clipped to
        ``dp_sgd.max_grad_norm`` instead of ``train.grad_clip``."""
        self.dp = dp
        self.use_amp, self.scaler = False, None

    @property
    def stage(self) -> str | None:
        """The stage of the round being trained, else of the last one trained (kept across restarts)."""
        return self._stage

    def record_locally(self, **values: Any) -> None:
        """Keep per-site diagnostics (e.g. Fed-MAS's w and ŵ) in the site's own log; they are never sent."""
        if self.local_log is not None:
            self.local_log(values)

    # ----- lifecycle called by the site runtime -----------------------------------------------------
    def receive(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Load the received global weights (never the private keys); a declared server array
        (``Payload.receives``) lands in ``self.received``, anything else the model lacks is an error."""
        declared = set(self.payload.receives)
        self.received = {k: np.asarray(v) for k, v in arrays.items() if k in declared}
        params = {k: v for k, v in arrays.items() if k not in declared}
        load_params(self.model, params, keep=lambda key: not self.payload.is_private(key))

    def outgoing_arrays(self, ctx: RoundContext | None = None) -> dict[str, np.ndarray]:
        """The arrays this site sends after training: its shared weights for this stage (the site runtime puts
        them in the job's wire format). Methods sending other arrays (e.g. probabilities) override this."""
        ctx = ctx or RoundContext(0, 1)
        keys = set(self.payload.shared_keys(list(self.model.state_dict()), ctx.stage))
        return model_params(self.model, keep=keys.__contains__) if keys else {}

    def state_dict(self) -> dict[str, Any]:
        """What this site keeps between rounds and across a restart: optimizer state, private parameters, stage,
        the method's :meth:`extra_state` and the DP-SGD accountant."""
        return {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "private": model_params(self.model, keep=self.payload.is_private), "stage": self._stage,
                "extra": self.extra_state(), "dp_sgd": self.dp.state_dict() if self.dp is not None else None}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (called when a site restarts inside a running job)."""
        load_params(self.model, state.get("private") or {}, keep=self.payload.is_private)
        self._stage = state.get("stage")
        self.train_cfg = self.job_train_cfg.for_stage(self._stage)
        if state.get("optimizer") is not None:
            self.optimizer = self._new_optimizer()
            self.optimizer.load_state_dict(state["optimizer"])
            self._optimizer_key = (self._stage, -1, -1)  # kept unless fresh_optimizer asks for a new one
        self.load_extra_state(state.get("extra") or {})
        if self.dp is not None and state.get("dp_sgd"):
            self.dp.load_state_dict(state["dp_sgd"])  # a restarted site keeps counting its ε

    def extra_evaluations(self, split: str) -> dict[str, Any]:
        """Method-declared evaluations {name: EvalStats} on ``split`` of the model as the site's last local training
        left it (called before the received model is loaded, e.g. FCA's personal head); the server sums them."""
        return {}

    def train_round(self, ctx: RoundContext, should_abort: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Run E local epochs (or ``max_steps``) and return this round's meta."""
        start = time.perf_counter()
        self.train_cfg = self.job_train_cfg.for_stage(ctx.stage)
        if ctx.stage != self._configured_stage:  # also after a restart: hooks may set up in-memory state
            self._configured_stage = ctx.stage
            self.on_stage_start(ctx)
        self._stage = ctx.stage
        self.on_round_start(ctx)
        self._round_ctx, self._round_steps = ctx, self._planned_steps()
        if self.dp is not None:  # before any step: a site never spends beyond its budget
            self.dp.check_budget(self._round_steps, self.train_cfg.batch_size)
        loss_sum, steps = 0.0, 0
        for epoch in range(self.train_cfg.local_epochs):
            self.model.train()
            epoch_loss, epoch_steps = self._train_epoch(should_abort, steps)
            loss_sum, steps = loss_sum + epoch_loss, steps + epoch_steps
            self.log(f"round {ctx.round + 1}/{ctx.total_rounds} epoch {epoch + 1}/{self.train_cfg.local_epochs}: "
                     f"loss {epoch_loss / max(epoch_steps, 1):.4f} over {epoch_steps} steps")
            if self.epoch_listener is not None and epoch_steps:
                self.epoch_listener(ctx.round * self.train_cfg.local_epochs + epoch, epoch_loss / epoch_steps)
            if self._step_cap_reached(steps) or should_abort():
                break
        meta = {contracts.N_SAMPLES: self.labelled_samples(), contracts.TRAIN_LOSS: loss_sum / max(steps, 1),
                contracts.TRAIN_SECONDS: time.perf_counter() - start,
                **({contracts.DP_EPSILON: self.dp.epsilon()} if self.dp is not None else {})}
        return {**meta, **self.round_meta(ctx)}

    @property
    def multi_label(self) -> bool:
        """Whether the site's labels are multi-hot rows (sigmoid per class) rather than class ids (softmax)."""
        return bool(getattr(self.data, "multi_label", False))

    def labelled_samples(self) -> int:
        """Training samples with a label (multi-label: with at least one known entry), the FedAvg weight."""
        if not self.multi_label:
            return int(self.class_counts.sum().item())
        return int((np.asarray(self.data.train.labels) >= 0).any(axis=1).sum())

    def supervised_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean CE over the labelled samples (multi-label: BCE over known entries), 0 for a batch without any."""
        if self.multi_label:
            return masked_bce(logits, labels)
        # DP-SGD: a mean over the batch's rows, which Opacus's per-sample gradients undo exactly (a mean over the
        # labelled rows would scale each sample's gradient by how many others in its batch are unlabelled)
        rows = labels.new_tensor(labels.shape[0]) if self.dp is not None else (labels >= 0).sum()
        return F.cross_entropy(logits, labels, ignore_index=-1, reduction="sum") / rows.clamp(min=1)

    def scores_and_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample scores (softmax, or sigmoid per class) and losses (CE, or mean BCE over known entries); an
        unlabelled sample (row without a known entry) has loss 0."""
        if self.multi_label:
            known = labels >= 0
            losses = F.binary_cross_entropy_with_logits(logits, labels.clamp(min=0).float(), reduction="none")
            return torch.sigmoid(logits), (losses * known).sum(dim=1) / known.sum(dim=1).clamp(min=1)
        losses = F.cross_entropy(logits, labels.clamp(min=0), reduction="none") * (labels >= 0)
        return torch.softmax(logits, dim=1), losses

    def predictions(self, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels, class probabilities, per-sample loss) of the current model on ``split``, rows in the dataset's
        order (they line up with per-sample attributes); multi-label: ``[N, K]`` labels and sigmoid scores."""
        loader = DataLoader(getattr(self.data, split), batch_size=self.train_cfg.eval_batch_size, shuffle=False)
        labels, probs, losses = [], [], []
        self.model.eval()
        with torch.no_grad():
            for images, batch_labels in loader:
                logits = self.predict_logits(images.to(self.device)).float()
                scores, loss = self.scores_and_losses(logits, batch_labels.to(self.device))
                labels.append(batch_labels.numpy())
                probs.append(scores.cpu().numpy())
                losses.append(loss.cpu().numpy())
        num_classes = int(self.data.num_classes)
        if not labels:
            label_shape = (0, num_classes) if self.multi_label else (0,)
            return np.zeros(label_shape, np.int64), np.zeros((0, num_classes)), np.zeros(0)
        return np.concatenate(labels), np.concatenate(probs), np.concatenate(losses)

    def evaluate(self, split: str) -> Any:
        """Summable evaluation statistics of the current model on ``split`` ('val' or 'test')."""
        return eval_stats(*self.predictions(split), num_classes=int(self.data.num_classes),
                          min_class_samples=self.min_class_samples)

    # ----- hooks ----------------------------------------------------------------------------------
    def on_round_start(self, ctx: RoundContext) -> None:
        """Called after the global model is loaded and before training (e.g. snapshot global weights)."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The method's training loss for one batch. Unlabelled samples (entries) carry -1 and are ignored."""
        return self.supervised_loss(self.model(images), labels)

    def extra_state(self) -> dict[str, Any]:
        """Method-specific state to keep across rounds and restarts (e.g. MOON's previous local model)."""
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`extra_state`."""

    def on_stage_start(self, ctx: RoundContext) -> None:
        """Called on the first round of a new stage, before training (e.g. switch the loss or the heads)."""

    def after_step(self) -> None:
        """Called after every optimizer step (e.g. an EMA teacher update)."""

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        """Method-specific meta to send (must be declared in the method's Payload)."""
        return {}

    def run_phase(self, phase: str, arrays: Mapping[str, np.ndarray],
                  ctx: RoundContext) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Handle a method-specific task (a phase other than train/validate). Returns (arrays, meta)."""
        raise PayloadError(f"this method has no task '{phase}'; the server and site run different methods")

    def predict_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Logits used for evaluation (a personalized method may combine heads)."""
        return self.model(images)

    def parameters_to_train(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # ----- internals ------------------------------------------------------------------------------
    def _get_optimizer(self, step_in_round: int) -> torch.optim.Optimizer:
        """The optimizer for one step of the current round, each group's lr set for that step; rebuilt (state
        dropped) when ``train.fresh_optimizer`` asks: per stage, round or step."""
        ctx = self._round_ctx
        key = (ctx.stage, ctx.round, step_in_round)
        if self.optimizer is None or rebuild_due(self.train_cfg.fresh_optimizer, self._optimizer_key, key):
            self.optimizer = self._new_optimizer()
        self._optimizer_key = key
        set_step_lr(self.optimizer, self.train_cfg, ctx.stage_round, ctx.stage_rounds, step_in_round, self._round_steps)
        return self.optimizer

    def _new_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the TrainConfig names over :meth:`parameters_to_train`, behind DP-SGD when it is on."""
        optimizer = build_optimizer(self.model, self.train_cfg, self.parameters_to_train())
        return self.dp.wrap(optimizer, self.train_cfg.batch_size) if self.dp is not None else optimizer

    def _planned_steps(self) -> int:
        """Optimizer steps this round will take: local epochs x batches, capped by ``max_steps``."""
        steps = self.train_cfg.local_epochs * len(self.train_loader())
        return max(1, min(steps, self.train_cfg.max_steps) if self.train_cfg.max_steps > 0 else steps)

    def _train_epoch(self, should_abort: Callable[[], bool], done: int):
        loss_sum, steps = 0.0, 0
        for images, labels in self.train_loader():
            if self._step_cap_reached(done + steps) or should_abort():
                break
            if not self.uses_unlabelled_samples and not bool((labels >= 0).any()) and self.dp is None:
                continue  # nothing to learn from in this batch (DP-SGD still takes the noised step it accounts)
            images, labels = images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            loss = self._step(images, labels, done + steps)
            loss_sum, steps = loss_sum + loss, steps + 1
        return loss_sum, steps

    def _step(self, images: torch.Tensor, labels: torch.Tensor, step_in_round: int) -> float:
        return self.optimizer_step(self._get_optimizer(step_in_round), lambda: self.compute_loss(images, labels))

    def optimizer_step(self, optimizer: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor]) -> float:
        """One update of ``optimizer`` on the loss ``loss_fn`` computes: AMP on GPU, a finite-loss check,
        gradient clipping and :meth:`after_step`. Shared by the main loop and a method's own loops (e.g.
        MDH-FL's distillation steps on public images). Returns the loss."""
        optimizer.zero_grad(set_to_none=True)
        if self.dp is not None:
            self.dp.clear_per_sample_gradients(self.model)
        with torch.autocast(device_type=self.device.type, enabled=self.use_amp):
            loss = loss_fn()
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
        if self.train_cfg.grad_clip > 0 and self.dp is None:  # DP-SGD clips each sample's gradient instead
            torch.nn.utils.clip_grad_norm_(self.parameters_to_train(), self.train_cfg.grad_clip)

    def _step_cap_reached(self, steps: int) -> bool:
        return self.train_cfg.max_steps > 0 and steps >= self.train_cfg.max_steps

    def train_dataset(self) -> Any:
        """The samples this round trains on (a method may train on a subset in some stage, e.g. labelled only)."""
        return self.data.train

    def train_loader(self) -> DataLoader:
        """Shuffled training batches of :meth:`train_dataset` (drop_last only when it leaves at least one batch)."""
        dataset = self.train_dataset()
        if self.dp is not None:  # Poisson sampling, as the accountant assumes
            return self.dp.loader(dataset, self.train_cfg.batch_size, self.train_cfg.num_workers,
                                  pin_memory=self.device.type == "cuda")
        return DataLoader(dataset, batch_size=self.train_cfg.batch_size, shuffle=True,
                          drop_last=len(dataset) > self.train_cfg.batch_size, num_workers=self.train_cfg.num_workers,
                          pin_memory=self.device.type == "cuda")


def small_classes(counts: np.ndarray, minimum: int) -> np.ndarray:
    """bool ``[K]``: the classes a site reports nothing about, under its policy's ``min_class_samples``: those it
    has some, but fewer than ``minimum``, samples of (a class it has none of reveals no one)."""
    counts = np.asarray(counts)
    return (counts > 0) & (counts < minimum)


def eval_stats(labels: np.ndarray, probs: np.ndarray, losses: np.ndarray, num_classes: int, keep=None,
               min_class_samples: int = 0) -> Any:
    """EvalStats of the labelled rows (only rows where ``keep`` is true, if given); multi-hot ``labels`` give
    MultiLabelEvalStats. A class with fewer than ``min_class_samples`` (the site policy's) among these rows is left out
    with its samples (multi-label: its entries, when its positives or negatives are below the minimum)."""
    from medflare.data.types import labelled_rows
    from medflare.metrics import EvalStats, MultiLabelEvalStats

    rows = labelled_rows(labels) if keep is None else labelled_rows(labels) & keep
    if min_class_samples > 0 and labels.ndim == 2:
        known = labels[rows] >= 0
        positives = (labels[rows] == 1).sum(axis=0)
        hidden = small_classes(positives, min_class_samples) | small_classes(known.sum(0) - positives,
                                                                             min_class_samples)
        labels = np.where(hidden[None, :], -1, labels)
        rows &= labelled_rows(labels)
    elif min_class_samples > 0:
        counts = np.bincount(labels[rows], minlength=num_classes)
        rows &= ~np.isin(labels, np.flatnonzero(small_classes(counts, min_class_samples)))
    kind = MultiLabelEvalStats if labels.ndim == 2 else EvalStats
    return kind.from_predictions(labels[rows], probs[rows], num_classes, loss_sum=float(losses[rows].sum()))


class ServerRule:
    """Server-side aggregation: sample-count-weighted average of every shared array (FedAvg). Subclasses change
    :meth:`site_weight` (e.g. RF), :meth:`site_weights` (weights that need every site), :meth:`row_weights` (per-class
    rows), or the shape of a round: :meth:`stages`, :meth:`phases`, what each phase sends (:meth:`phase_arrays`, per
    site if needed) and expects back (:meth:`expected_arrays`). Keys a site never sends (private keys) keep the server's
    value. Pure numpy: the FLARE layer calls these hooks. Takes the method's config, the job's rounds (all stages
    together) and the method's Payload."""

    # Why the server cannot aggregate this rule's results encrypted (``secure_aggregation=he``), "" when it can: it
    # weighs the ciphertexts with the bounded shares of :meth:`weighting`, so a rule qualifies when its weights,
    # checks and round info read only meta and declared arrays (reading a model weight fails loudly). A rule whose
    # aggregate is not that weighted sum (a median, a clipped mix of predictions) says why here.
    encrypted_aggregation_refusal: ClassVar[str] = ""

    def __init__(self, method_cfg: Any, total_rounds: int, payload: Payload = Payload()) -> None:
        self.cfg, self.total_rounds, self.payload = method_cfg, total_rounds, payload
        self.multi_label = False  # set by the server from the job's task (multi-label rules may add a phase)
        # The job's robust.max_share, set by the server: a rule that derives a server-side array from site counts
        # bounds each site's say with it (ops.influence.bound); weights and mixtures the server bounds itself
        self.share_cap = 0.0

    def stages(self) -> list[Stage]:
        """Stages run in order; their rounds add up to the job's rounds. Multi-stage methods override."""
        return [Stage("train", self.total_rounds)]

    def phases(self, ctx: RoundContext) -> list[str]:
        """Task names sent to the sites in one round, in order; the last phase's updates are aggregated (a
        logit-exchange method returns e.g. ["public_probs", "train"])."""
        return [contracts.TRAIN_PHASE]

    def array_dims(self, phase: str, ctx: RoundContext) -> dict[str, int]:
        """Named dimensions of the arrays declared for ``phase`` (e.g. {"rows": public chunk size}); called after
        :meth:`phase_arrays` of the same phase, so it may use what that call learnt from earlier phases."""
        return {}

    def phase_arrays(self, phase: str, ctx: RoundContext, global_params: Mapping[str, np.ndarray],
                     earlier: Mapping[str, list[SiteUpdate]]) -> dict[str, np.ndarray] | PerSite | Mixture:
        """What the server sends with ``phase``'s task, given this round's validated results of earlier phases: one
        dict for every site, :class:`PerSite`, or a :class:`~medflare.ops.influence.Mixture` of arrays the sites sent
        (the server bounds each source's share and builds every receiver's array). By default the "train" task
        carries the global weights that travel in this stage, other phases nothing."""
        if phase != contracts.TRAIN_PHASE:
            return {}
        return {k: global_params[k] for k in self.payload.shared_keys(list(global_params), ctx.stage)}

    def expected_arrays(self, phase: str, ctx: RoundContext, global_params: Mapping[str, np.ndarray],
                        contract: ContractContext) -> dict[str, contracts.Expected]:
        """key -> what a valid result of ``phase`` carries: the stage's shared weights in "train", exact dtype,
        plus the arrays the payload declares for the phase."""
        expected = contracts.array_expectations(self.payload.arrays_for(phase), contract)
        if phase == contracts.TRAIN_PHASE:
            keys = self.payload.shared_keys(list(global_params), ctx.stage)
            transfer = str(ctx.server_meta.get(contracts.TRANSFER_DTYPE, "float32"))
            kind = str(ctx.server_meta.get(contracts.TRANSFER_KIND, "weights"))
            expected.update(contracts.weight_expectations(global_params, keys, transfer, kind))
        return expected

    def server_meta(self, ctx: RoundContext) -> dict[str, Any]:
        """Extra meta sent to every site with the round's tasks."""
        return {}

    def site_weight(self, update: SiteUpdate, ctx: RoundContext) -> float:
        """A site's raw scalar aggregation weight: its labelled sample count."""
        return float(update.meta[contracts.N_SAMPLES])

    def site_weights(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, float]:
        """Every site's raw scalar weight this round (a rule whose weights depend on all sites overrides this)."""
        return {u.site: self.site_weight(u, ctx) for u in updates}

    def row_weights(self, updates: list[SiteUpdate]) -> dict[str, dict[str, np.ndarray]] | None:
        """Optional key -> site -> raw per-row weights (row-wise classifier aggregation)."""
        return None

    def weighting(self, updates: list[SiteUpdate], ctx: RoundContext) -> Weighting:
        """What this round's aggregate combines, as raw per-site weights: the server bounds them
        (:func:`medflare.ops.influence.bound`) and does the combining; a rule never weights sites around that."""
        return Weighting(self.site_weights(updates, ctx), self.row_weights(updates) or {})

    def check_update(self, phase: str, update: SiteUpdate, ctx: RoundContext) -> None:
        """Method-specific consistency checks of one validated result, beyond its declared shapes and ranges
        (e.g. counts that must agree with each other). Raise PayloadError to refuse it."""

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        """What to record about this round besides the shares."""
        return {}

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What this rule carries from round to round that a resumed job continues from, as (JSON-able facts,
        arrays): written into the server's own round checkpoint, never sent. A rule without such state: nothing."""
        return {}, {}

    def restore(self, facts: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Continue from what :meth:`checkpoint` returned in the crashed job being resumed (ValueError if unusable)."""

    def streams(self, ctx: RoundContext) -> bool:
        """Whether this round's aggregate is Σ site_weight·arrays / Σ site_weight, so the server may add each result
        to a running sum as it arrives (``stream_aggregation``) and keep no site's model arrays: true unless the rule
        overrides :meth:`site_weights`, :meth:`row_weights`, :meth:`weighting` or :meth:`phases` (and not this). The
        server checks a share cap (which needs every site at once) itself. A streamed round's :meth:`round_info`
        sees each update's meta and declared arrays, not its model arrays."""
        hooks = ("site_weights", "row_weights", "weighting", "phases")  # overridden in a subclass or on the instance
        return all(getattr(getattr(self, name), "__func__", None) is getattr(ServerRule, name) for name in hooks)

    def shares(self, updates: list[SiteUpdate], ctx: RoundContext, cap: float = 0.0) -> dict[str, float]:
        """Each site's bounded scalar share of the aggregate (its weight over the sum, capped at ``cap``)."""
        return bound(self.weighting(updates, ctx), cap).sites

    def aggregate(self, global_params: Mapping[str, np.ndarray], updates: list[SiteUpdate], ctx: RoundContext,
                  cap: float = 0.0) -> AggregateResult:
        """The next global model from this rule's :meth:`weighting`, bounded by ``cap`` (the server calls
        :func:`aggregate_updates` with the job's cap; a rule must not override this)."""
        return aggregate_updates(self, global_params, updates, ctx, cap)

    def final_metrics(self, final: Mapping[str, Any]) -> dict[str, Any]:
        """Method-named figures derived from the final evaluation (e.g. FCA's generalization/specialization)."""
        return {}


def aggregate_updates(rule: ServerRule, global_params: Mapping[str, np.ndarray], updates: list[SiteUpdate],
                      ctx: RoundContext, cap: float = 0.0,
                      combiner: Callable[..., dict[str, Any]] = combine) -> AggregateResult:
    """The next global model: the rule's raw :meth:`ServerRule.weighting`, bounded (no site above ``cap`` in any part),
    then combined by ``combiner`` (``combine``, or with encrypted aggregation ``ops.he_aggregate.combine_encrypted``
    over ciphertexts: the bound always comes first, in plaintext). Keys a site never sends (private keys) keep the
    server's value. The info holds the rule's round info and, with row weights, ``largest_share`` (site -> its largest
    share of any row), so a round's record shows the bound held."""
    weighting = rule.weighting(updates, ctx)
    shares = bound(weighting, cap)
    arrays = {u.site: {k: v for k, v in u.arrays.items() if k in global_params} for u in updates}
    dtypes = {k: np.asarray(v).dtype for k, v in global_params.items()}
    combined = combiner(arrays, shares, dtypes) if any(arrays.values()) else {}
    info = rule.round_info(updates, ctx)
    if shares.rows:
        info = {**info, LARGEST_SHARE: shares.largest()}
    return AggregateResult(params={**dict(global_params), **combined}, shares=shares.sites, info=info)


def require(ok: bool, message: str) -> None:
    """One check of a method's options: ConfigError(message) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


ModelBuilder = Callable[..., nn.Module]


def default_model_builder(model: str, num_classes: int, in_channels: int, image_size: int, pretrained: str | None,
                          method_cfg: Any = None) -> nn.Module:
    """The plain classifier from the model factory."""
    from medflare.models import create_model

    return create_model(model, num_classes, in_channels, pretrained=pretrained, image_size=image_size)


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: everything the CLI, the FLARE layer and the contract tests need."""

    name: str  # registry key used on the command line (e.g. ``bsm-fl``)
    summary: str  # one line for ``medflare methods``
    config_cls: type  # dataclass of the method's hyperparameters
    trainer_cls: type[LocalTrainer]
    payload: Payload = Payload()  # what leaves a site
    # the payload of a job's method config when its meta bounds depend on it (Fed-MAS's RF: <= 1 normalised, larger
    # as Eq. 3 prints it); None = ``payload`` for every config. Only meta validators may differ from ``payload``.
    payload_for: Callable[[Any], Payload] | None = None
    server_rule_cls: type[ServerRule] = ServerRule
    build_model: ModelBuilder = default_model_builder  # network builder (method-specific heads go here)
    train_defaults: Mapping[str, Any] = field(default_factory=dict)  # TrainConfig overrides the method's paper uses
    reference: str = ""  # paper or source the method follows
    # optional picture of a site's local log records (simulation copies site logs out)
    site_log_plot: Callable[[list[dict[str, Any]], Any], Any] | None = None
    # False when the server holds no model at all (no weights travel, e.g. MDH-FL): the persisted global model is
    # then empty and every site may run its own architecture
    server_model: bool = True
    # run-config overrides for the smallest meaningful job (the every-method simulator test runs it)
    smoke: Mapping[str, Any] = field(default_factory=dict)
    default_model: str = "cnn"  # the network a job trains when it names none (``--model``)
    # False when the global model has no classifier of its own (FedRep: every head is private), so the final
    # pooled test scores each site's own model, not the saved global model
    global_classifier: bool = True
    # what the method's own messages (beyond the common meta) tell the server about a site's data, for privacy
    # reviewers; docs/privacy.md is generated from it and the Payload
    reveals: str = "nothing beyond the model weights and the common meta"
    # whether the method trains multi-label tasks (sigmoid per class); an unmarked one is refused for them
    multi_label: bool = False
    # pre-launch checks of what the run's options alone decide, called by plan.build_plan: (method config,
    # {site: resolved TrainConfig}, simulated DataConfig or None when each site reads its own data) -> problems,
    # one sentence each naming the option to change. What only loaded data decides stays in the trainer.
    check_run: Callable[[Any, Mapping[str, TrainConfig], Any], list[str]] | None = None
    # DataConfig options of the paper's evaluation protocol for simulated data, e.g. FCA's {"eval_split":
    # "like_train"}; plan.validated applies them under the job's own data options (which win), never for
    # site-local data, and like_train not for a multi-label task; the run's config records them
    data_defaults: Mapping[str, Any] = field(default_factory=dict)
    # named run-config presets (``--preset NAME``), e.g. {"paper": Preset(...)} (medflare.methods.presets)
    presets: Mapping[str, Preset] = field(default_factory=dict)
    # why the local update cannot run as DP-SGD (medflare.dp_sgd), one line; "" when it is a per-sample loss over
    # the site's private samples, which Opacus clips and noises. A dp_sgd job is refused for a method with a reason.
    dp_sgd_blocker: str = ""
    # what a site's ε does not cover besides the common meta (evaluation counts, n_samples), e.g. class counts its
    # loss reads or values it sends that no noised step produced; docs/privacy.md is generated from it
    dp_sgd_uncovered: str = ""

    def __post_init__(self) -> None:
        if not self.server_model and self.payload.sends_weights:
            raise ValueError(f"method '{self.name}': a server without a model cannot receive weights")

    def payload_of(self, method_cfg: Any) -> Payload:
        """What a site of a job with ``method_cfg`` may send: both ends check its results against this one."""
        if self.payload_for is None:
            return self.payload
        payload = self.payload_for(method_cfg)
        if replace(payload, meta=self.payload.meta) != self.payload:
            raise ValueError(f"method '{self.name}': payload_for may change only the meta validators")
        return payload

    def config_of(self, method_args: Any) -> Any:
        """The method's typed configuration: a plan's (``RunPlan.method_cfg``) as it is, else options typed here."""
        return method_args if isinstance(method_args, self.config_cls) else self.config_cls(**dict(method_args or {}))


# MethodSpec.dp_sgd_uncovered of a method whose loss reads the site's class counts (balanced softmax, calibration)
COUNTS_UNCOVERED = ("the site's class counts its loss reads: ε covers the noised steps given those counts, not the "
                    "counts")
BUILTIN_METHODS: list[MethodSpec] = []  # medflare's own methods, in the order medflare.methods imports them


def builtin_method(spec: MethodSpec) -> MethodSpec:
    """Declare one of medflare's own methods (a method folder's ``__init__``); :mod:`medflare.registry` looks them
    up. A method from outside medflare calls ``registry.register_method`` instead."""
    if any(known.name == spec.name for known in BUILTIN_METHODS):
        raise ValueError(f"method '{spec.name}' is registered twice")
    BUILTIN_METHODS.append(spec)
    return spec
