"""Everything a site does for a method, without FLARE: build data, model and trainer; train; evaluate. The FLARE
executor is a thin shell around :class:`SiteRuntime`, so the site side is tested without starting FLARE."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from medflare import contracts
from medflare.contracts import ContractContext
from medflare.errors import DataError
from medflare.methods.base import LocalTrainer, RoundContext, eval_stats
from medflare.models import get_device, place_model
from medflare.ops.background import BackgroundWrite
from medflare.ops.timing import timed
from medflare.ops.wire import encode_weights
from medflare.site_config import SiteSettings, typed_data_config

SITE_LOG_FILE = "medflare_site_log.jsonl"  # per-site diagnostics that never leave the site
SITE_STATE_FILE = "medflare_site_state.pt"  # optimizer, private keys and method state of the running job
TASK_SECONDS_EVENT = "task_seconds"  # site-log record: where a train task's time went (evaluate, train, encode, ...)


def load_site_data(settings: SiteSettings, site_index: int, site_name: str, pooled_test: bool = False) -> Any:
    """The site's data (``medflare.data.SiteData``) checked against the job's task: class names (with the site's
    ``class_map``), channels, single- or multi-label; also what ``medflare preflight --job`` runs.
    ``pooled_test``: the trainer scores its own model on the pooled test set (FCA). Raises DataError (one line
    naming the site) when the data cannot be read or does not fit the task."""
    from medflare.data import make_site_data
    from medflare.data.classes import left_out_classes, unnamed_job_refusal
    from medflare.data.sources import load_source

    cfg = typed_data_config({**settings.data, "num_classes": settings.task.num_classes})
    if not settings.task.class_names:  # a job from before every job named its classes, or class_names set to null
        info = load_source(cfg.source, seed=cfg.seed, left_out=left_out_classes(cfg.class_map)).info
        if info.get("named_classes"):
            raise DataError(unnamed_job_refusal(info["class_names"], site_name))
    data = make_site_data(cfg, site_index, site_name, pooled_test=pooled_test, class_names=settings.task.class_names)
    task = settings.task
    if data.channels != task.in_channels:
        raise DataError(
            f"{site_name}: images have {data.channels} channel(s) but the job declares "
            f"in_channels={task.in_channels}; fix the job's task.in_channels or the site's data"
        )
    if data.multi_label != task.multi_label:
        kinds = ("single-label", "multi-label")
        raise DataError(
            f"{site_name}: the site's data is {kinds[data.multi_label]} but the job declares a "
            f"{kinds[task.multi_label]} task; fix the job's task.multi_label or the site's labels"
        )
    return data


class SiteRuntime:
    """A site's live state for one job: data, model, trainer (optimizer and personal state persist)."""

    def __init__(
        self,
        settings: SiteSettings,
        site_name: str,
        site_index: int,
        log: Callable[[str], None] = print,
        local_dir: str | Path | None = None,
    ):
        self.settings = settings
        self.site_name = site_name
        self.spec = settings.spec
        self.method_cfg = settings.method_args  # typed once, by the plan (or SiteSettings for options by hand)
        self.train_cfg = settings.train
        self.log = log
        torch.manual_seed(settings.seed + site_index)
        if self.train_cfg.torch_threads > 0:
            torch.set_num_threads(self.train_cfg.torch_threads)
        self.device = get_device()  # CUDA when the site has a GPU, else CPU
        self.data = self._load_data(site_index)
        self.model = self._build_model()
        self.payload = self.spec.payload_of(self.method_cfg)  # what this job's sites may send (both ends check it)
        self.trainer: LocalTrainer = self.spec.trainer_cls(
            self.model, self.data, self.train_cfg, self.method_cfg, self.payload, self.device, log
        )
        self.trainer.min_class_samples = settings.min_class_samples
        if settings.dp_sgd:
            self._enable_dp_sgd()
        if local_dir is not None:
            self.trainer.local_log = JsonLinesLog(Path(local_dir) / SITE_LOG_FILE)
        self.model_keys = list(self.model.state_dict().keys())
        self.state_path = Path(local_dir) / SITE_STATE_FILE if local_dir is not None else None
        self._state_write = BackgroundWrite(f"{site_name}-state")
        self._restore_state()  # a site process restarted inside a running job continues where it stopped

    def _load_data(self, site_index: int) -> Any:
        from medflare.data.readers import channel_mix_note, window_note

        pooled_test = bool(getattr(self.spec.trainer_cls, "scores_pooled_test", False))
        data = load_site_data(self.settings, site_index, self.site_name, pooled_test)
        self.log(f"{len(data.train)} train / {len(data.val)} val / {len(data.test)} test images")
        for note in data.class_notes:  # missing classes, classes left out: the site's admin reads them here
            self.log(note)
        paths = data.train.images.paths or ()
        for note in (window_note(paths, data.train.images.window), channel_mix_note(paths, data.channels)):
            if note:
                self.log(f"note: {note}")
        return data

    def _build_model(self) -> torch.nn.Module:
        task = self.settings.task
        model = self.spec.build_model(
            self.settings.model, task.num_classes, task.in_channels, task.image_size, None, self.method_cfg
        )
        if self.settings.dp_sgd:  # the architecture the server built for this job (flare.models.global_model_of)
            from medflare.dp_sgd import check_method_supports_dp, dp_compatible_model

            check_method_supports_dp(self.settings.method, self.spec.dp_sgd_blocker)
            model = dp_compatible_model(model)
        return place_model(model, self.device)

    def _enable_dp_sgd(self) -> None:
        """Per-sample clipping, noise and this site's accountant for the whole job (kept in its state file)."""
        from medflare.dp_sgd import PrivateTraining

        cfg = self.settings.dp_sgd  # typed where the site resolved it (site_config.resolve_site_dp)
        self.trainer.enable_dp_sgd(PrivateTraining(cfg, self.model, len(self.trainer.train_dataset())))
        budget = f", budget ε ≤ {cfg.max_epsilon:g}" if cfg.max_epsilon > 0 else ""
        self.log(f"DP-SGD: σ = {cfg.noise_multiplier:g}, C = {cfg.max_grad_norm:g}, δ = {cfg.delta:g}, "
                 f"{cfg.accountant.upper()} accountant{budget}")

    def train(
        self, arrays: Mapping[str, np.ndarray], ctx: RoundContext, should_abort: Callable[[], bool] = lambda: False
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Score the site's own model (method-declared evaluations), load the received arrays, score the global
        model, train locally; return what the method declares it sends for this stage."""
        began_at = time.time()  # wall clock, shared with the server on one machine: splits a round's time
        self._state_write.wait()  # the previous task's state is on disk before this task changes it
        scoring = ctx.scored and self.settings.evaluation == "every_round"
        spans: dict[str, float] = {}  # where this task's time goes; kept in the site's own log, never sent
        with timed(spans, "evaluate"):
            meta = self._extra_evaluation_meta() if scoring else {}
        with timed(spans, "receive"):
            self.trainer.receive(arrays)
        with timed(spans, "evaluate"):
            if scoring:
                meta.update(self._evaluation_meta())
        with timed(spans, "train"):
            meta.update(self.trainer.train_round(ctx, should_abort))
        with timed(spans, "encode"):
            out_arrays = self._to_wire(self.trainer.outgoing_arrays(ctx), arrays, ctx)
            self._check_outgoing(out_arrays, meta, contracts.TRAIN_PHASE, ctx)
        with timed(spans, "save_state"):
            self.save_state()
        self.trainer.record_locally(event=TASK_SECONDS_EVENT, round=ctx.round, seconds=spans,
                                    wall={"began": began_at, "ended": time.time()})
        return out_arrays, meta

    def run_phase(
        self, phase: str, arrays: Mapping[str, np.ndarray], ctx: RoundContext
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """A method-specific task; its result is checked against the payload like any other."""
        self._state_write.wait()
        out_arrays, meta = self.trainer.run_phase(phase, arrays, ctx)
        self._check_outgoing(out_arrays, meta, phase, ctx)
        self.save_state()
        return out_arrays, meta

    def validate(self, arrays: Mapping[str, np.ndarray], ctx: RoundContext | None = None) -> dict[str, Any]:
        """Score the site's own model and the received (final) model without training."""
        self._state_write.wait()
        ctx = ctx or RoundContext(0, 1)
        scoring = self.settings.evaluation != "off"
        meta = self._extra_evaluation_meta() if scoring else {}
        self.trainer.receive(arrays)
        if scoring:
            meta.update(self._evaluation_meta())
        self._check_outgoing({}, meta, "validate", ctx)
        return meta

    def _to_wire(
        self, arrays: Mapping[str, np.ndarray], received: Mapping[str, np.ndarray], ctx: RoundContext
    ) -> dict[str, np.ndarray]:
        """Model weights in the job's wire format (dtype; weights or differences); other arrays as they are."""
        weights = {k: v for k, v in arrays.items() if k in self.model_keys}
        dtype = str(ctx.server_meta.get(contracts.TRANSFER_DTYPE, "float32"))
        kind = str(ctx.server_meta.get(contracts.TRANSFER_KIND, "weights"))
        return {**encode_weights(weights, received, dtype, kind), **{k: v for k, v in arrays.items() if k not in weights}}

    def _check_outgoing(self, arrays: Mapping[str, Any], meta: Mapping[str, Any], phase: str, ctx: RoundContext) -> None:
        task = self.settings.task
        dims = ctx.server_meta.get(contracts.ARRAY_DIMS) or {}
        contract = ContractContext(task.num_classes, dims=dims, multi_label=task.multi_label,
                                   local_epochs=self.train_cfg.local_epochs)
        self.payload.check_outgoing(arrays, meta, self.model_keys, contract, phase=phase, stage=ctx.stage)

    # ----- state kept at the site ------------------------------------------------------------------
    def save_state(self) -> None:
        """Write the trainer's state (optimizer, private keys, method state) into the site's job workspace, in the
        background while the result travels (Adam state can take a second on a busy disk); every task waits for it
        before touching the trainer, so the file never mixes two rounds."""
        if self.state_path is None:
            return
        path, state = self.state_path, self.trainer.state_dict()

        def write() -> None:
            tmp = path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)  # never a half-written state file

        self._state_write.start(write)

    def _restore_state(self) -> None:
        if self.state_path is None or not self.state_path.is_file():
            return
        self.trainer.load_state(torch.load(self.state_path, map_location=self.device, weights_only=False))
        self.log(f"restored this site's state for the running job from {self.state_path.name}")

    def close(self) -> None:
        """Finish the state write in flight (the data-parallel site also stops its helper ranks)."""
        self._state_write.wait()

    def shared_weights(self) -> dict[str, np.ndarray]:
        """The site's current shareable weights (for submit_model / cross-site evaluation)."""
        return self.trainer.outgoing_arrays()

    def _evaluation_meta(self) -> dict[str, Any]:
        """Summable statistics of the received model: val, test, and test per image attribute when known."""
        num_classes, floor = self.settings.task.num_classes, self.trainer.min_class_samples
        labels, probs, losses = self.trainer.predictions("test")
        meta = {
            contracts.EVAL_VAL: self.trainer.evaluate("val").to_dict(),
            contracts.EVAL_TEST: eval_stats(labels, probs, losses, num_classes, min_class_samples=floor).to_dict(),
        }
        attributes = self.data.attributes_test
        if attributes is not None:
            meta[contracts.EVAL_TEST_BY_ATTRIBUTE] = {
                str(value): eval_stats(labels, probs, losses, num_classes, keep=attributes == value,
                                       min_class_samples=floor).to_dict()
                for value in np.unique(attributes)
            }
        return meta

    def _extra_evaluation_meta(self) -> dict[str, Any]:
        """Method-declared evaluations of the site's own model (before the received model is loaded)."""
        extra: dict[str, dict[str, Any]] = {}
        for split in ("val", "test"):
            for name, stats in self.trainer.extra_evaluations(split).items():
                extra.setdefault(name, {})[split] = stats.to_dict()
        return {contracts.EVAL_EXTRA: extra} if extra else {}


class JsonLinesLog:
    """Appends one JSON object per line to a file in the site's own workspace."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
