"""Everything a site does for a method, without FLARE: build data, model and trainer; train; evaluate.

The FLARE executor is a thin shell around :class:`SiteRuntime`, so the whole site side can be tested (and
benchmarked against a bare PyTorch loop) without starting FLARE.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from medflare import contracts
from medflare.config import from_dict
from medflare.contracts import ContractContext
from medflare.errors import ConfigError, DataError
from medflare.methods.base import LocalTrainer, MethodSpec, RoundContext, TrainConfig, eval_stats
from medflare.models import get_device, place_model
from medflare.ops.background import BackgroundWrite
from medflare.ops.timing import timed
from medflare.ops.wire import encode_weights
from medflare.registry import get_method

SITE_CONFIG_FILE = "medflare_site.json"  # in a site's local/ folder (POC and production)
ALLOW_JOB_DATA = "allow_job_data"  # a site's opt-in (in that file): jobs may bring their own, e.g. simulated, data
EVALUATION_MODES = ("every_round", "final", "off")
SITE_LOG_FILE = "medflare_site_log.jsonl"  # per-site diagnostics that never leave the site
SITE_STATE_FILE = "medflare_site_state.pt"  # optimizer, private keys and method state of the running job
TASK_SECONDS_EVENT = "task_seconds"  # site-log record: where a train task's time went (evaluate, train, encode, ...)


@dataclass
class TaskSpec:
    """Facts about the task that site and server must agree on (no data, no paths).

    ``multi_label``: several findings per image (multi-hot labels, sigmoid scores, BCE); the data decides it in
    simulation, a job on site-local data declares it.
    ``class_names`` (optional, for reports and ``medflare predict``) come from the data or ``task.class_names``.
    """

    num_classes: int
    in_channels: int
    image_size: int
    multi_label: bool = False
    class_names: list[str] | None = None


@dataclass
class SiteSettings:
    """One site's full configuration, assembled from the job and (in POC/production) the site's own file."""

    method: str
    task: TaskSpec
    data: dict[str, Any]
    model: str = "cnn"
    method_args: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    evaluation: str = "every_round"  # every_round | final | off: when the site sends evaluation counts
    dp_sgd: dict[str, Any] = field(default_factory=dict)  # DP-SGD as this site trains it (resolve_site_dp); {} = off
    min_class_samples: int = 0  # the site policy's floor: no statistics about a class with fewer samples leave

    def __post_init__(self) -> None:
        if self.evaluation not in EVALUATION_MODES:
            raise ConfigError(f"evaluation must be one of {EVALUATION_MODES}, got '{self.evaluation}'")


def check_multi_label_support(spec: MethodSpec, task: TaskSpec) -> None:
    """A multi-label task needs a method that declares it can train one (``MethodSpec.multi_label``)."""
    if task.multi_label and not spec.multi_label:
        from medflare.registry import get_method, list_methods

        able = [name for name in list_methods() if get_method(name).multi_label]
        raise ConfigError(
            f"method '{spec.name}' trains single-label classifiers (softmax over classes) and cannot run this "
            f"multi-label task; use one of {', '.join(able)}"
        )


# The arguments of the FLARE filters :class:`medflare.flare.privacy.UpdatePrivacy` applies, by its filter names
DP_FILTER_ARGS = {
    "percentile": ("percentile", "gamma"),
    "svt": ("fraction", "epsilon", "noise_var", "gamma", "tau", "replace", "epsilon_threshold", "epsilon_query",
            "epsilon_release"),
}


def check_dp_filter(dp: Mapping[str, Any]) -> None:
    """A job's dp result filter (``{"filter": ..., "args": {...}}``) as the sites' UpdatePrivacy takes it, checked
    without FLARE (ConfigError: an unknown option, filter or filter argument)."""
    unknown = sorted(set(dp) - {"filter", "args"})
    name, args = dp.get("filter", "percentile"), dp.get("args") or {}
    if unknown:
        raise ConfigError(f"dp: unknown option(s) {', '.join(unknown)}; valid options: filter, args")
    if name not in DP_FILTER_ARGS:
        raise ConfigError(f"dp: UpdatePrivacy filter must be one of {sorted(DP_FILTER_ARGS)}, got '{name}'")
    wrong = sorted(set(args) - set(DP_FILTER_ARGS[name])) if isinstance(args, Mapping) else [repr(args)]
    if wrong:
        raise ConfigError(f"dp: args {', '.join(wrong)} not taken by FLARE's '{name}' filter; it takes "
                          f"{', '.join(DP_FILTER_ARGS[name])}")


def resolve_train_config(spec: MethodSpec, overrides: Mapping[str, Any] | None) -> TrainConfig:
    """TrainConfig = shared defaults <- the method's paper defaults <- the job's overrides.

    Per-stage overrides (``stages``) merge stage by stage and option by option, so a job can change one
    option of one stage and keep the method's other stage defaults.
    """
    defaults, job = dict(spec.train_defaults), dict(overrides or {})
    merged = {**defaults, **job}
    if isinstance(defaults.get("stages"), Mapping) and isinstance(job.get("stages"), Mapping):
        names = {**defaults["stages"], **job["stages"]}
        merged["stages"] = {n: {**defaults["stages"].get(n, {}), **job["stages"].get(n, {})} for n in names}
    return from_dict(TrainConfig, merged, "train")


# Data options a job may set at a site that reads its own data (``{"source": "site"}``). None of them names a file
# or folder: each only reshuffles, resizes, relabels or subsets, in memory, the images the site's own
# ``medflare_site.json`` names, so a job cannot make the site read (or send results about) anything else.
JOB_SETTABLE_DATA_KEYS = frozenset({
    "augment",  # training augmentation of the same images
    "image_size",  # the size the same images are resized to
    "seed",  # reseeds the site's own splits and label draws; job templates send it
    "partition",  # simulation only (ignored when local); job templates send it
    "eval_split",  # simulation only (ignored when local)
    "min_size",  # a size check of simulated training slices
    "num_classes",  # a check; the runtime replaces it with the job's task.num_classes anyway
    "label_noise",  # flips some of the site's own training labels (robustness studies)
    "noise_kind",  # how label_noise flips them
    "label_fraction",  # hides some of the site's own training labels
    "imbalance",  # long-tail cut: trains on a subset of the same training images
    "window",  # intensity window of the same DICOM/NIfTI files: numbers, a preset or the files' own header
    "site_shift",  # pixel shift of in-memory demo sources (a file source refuses it)
})
# Only the site's own file sets these: they name what is read (source, public_source), carve the site's images
# into a set whose predictions go to the server (public_fraction), or state what its labels mean (identified,
# class_map: its own class names -> the job's).
# The refusal covers every key outside JOB_SETTABLE_DATA_KEYS; this set records the review of DataConfig's fields.
SITE_ONLY_DATA_KEYS = frozenset({"source", "public_source", "public_fraction", "identified", "class_map"})
# Fixed by medflare at a site that reads its own data: a job's (or the file's) value is replaced.
SITE_FIXED_DATA = {"local": True, "num_sites": 1}


def read_site_data_config(
    site_config_dir: str | Path | SiteFile, job_data: Mapping[str, Any] | None, simulated: bool = False
) -> dict[str, Any]:
    """The data config a site uses: the hospital, not the job, decides.

    A site with a ``local/medflare_site.json`` always follows it: the job's ``{"source": "site"}`` (or nothing)
    reads the file's ``data``, plus the job's options in :data:`JOB_SETTABLE_DATA_KEYS` the file does not set; a
    job that names its own source, or sets any other data key the file does not set (e.g. ``public_source``), is
    refused unless the file opts in with ``"allow_job_data": true`` (a test or POC site). Only FLARE's
    simulator, whose sites have no such file, takes the job's partitioned data spec without an opt-in.

    Args:
        site_config_dir: the site's ``local/`` folder (or its file, read).
        job_data: the data block of the job's executor config.
        simulated: True in FLARE's simulator (its engine sets ``FLContextKey.SIMULATE_MODE``, which a job's
            configuration cannot set); False in POC and production.

    Raises:
        DataError: the job's data is refused, or the site's file is missing, not JSON or has no ``data`` object.
    """
    site_file = SiteFile.of(site_config_dir)
    path, opted_in = site_file.path, site_file.get(ALLOW_JOB_DATA) is True
    job_source = (job_data or {}).get("source", "site")
    if job_source != "site":
        if (site_file.content is None and simulated) or opted_in:
            return dict(job_data or {})
        raise DataError(
            f"refused: the job names its own data (source '{job_source}'), but this site reads only the data in "
            f"its {path}. Submit the job with {{\"source\": \"site\"}}, or (test sites only) add "
            f'"{ALLOW_JOB_DATA}": true to that file'
        )
    site_data = _site_data_block(path, site_file.content)
    job_options = {k: v for k, v in (job_data or {}).items() if k != "source"}
    if not opted_in:
        _refuse_site_only_keys(job_options, site_data, path)
    return {**job_options, **site_data, **SITE_FIXED_DATA}


def _site_data_block(path: Path, site_file: dict[str, Any] | None) -> dict[str, Any]:
    """The ``data`` object of the site's file, which must name its source (without one the data would default to
    medflare's synthetic images, and a hospital would train on them without a word).

    Raises:
        DataError: the file is missing, has no ``data`` object, or that object names no ``source``.
    """
    if site_file is None:
        raise DataError(
            f"this site has no data configured: {path} is missing. Create it with "
            '{"data": {"source": "folder:/path/to/images"}} (or csv:/path/manifest.csv, medmnist:/path/file.npz)'
        )
    site_data = site_file.get("data")
    if not isinstance(site_data, dict):
        raise DataError(f"{path} has no 'data' object; add e.g. {{\"data\": {{\"source\": \"folder:/path\"}}}}")
    source = site_data.get("source")
    if not isinstance(source, str) or not source.strip():
        raise DataError(f"{path}: its 'data' object names no source, so this site has no images to train on; add "
                        '"source", e.g. {"data": {"source": "folder:/path/to/images"}} (or csv:/path/manifest.csv, '
                        "medmnist:/path/file.npz)")
    return site_data


def _refuse_site_only_keys(job_options: Mapping[str, Any], site_data: Mapping[str, Any], path: Path) -> None:
    """Refuse the job's data keys that only the site may set (and its file does not): refused, not dropped, so
    the job's author learns the option had no effect.

    Raises:
        DataError: naming the refused keys and the keys a job may set.
    """
    refused = sorted(set(job_options) - JOB_SETTABLE_DATA_KEYS - set(SITE_FIXED_DATA) - set(site_data))
    if refused:
        raise DataError(
            f"refused: the job sets data key(s) {', '.join(refused)}, which this site sets only in its own {path}; "
            f"remove them from the job (a job may set only {', '.join(sorted(JOB_SETTABLE_DATA_KEYS))})"
        )


def resolve_site_model(
    method: str, job_model: str, site_models: Mapping[str, str] | None, site: str,
    site_config_dir: str | Path | SiteFile | None,
) -> str:
    """The architecture this site trains: its own ``local/medflare_site.json`` "model", else the job's per-site
    choice (``site_model``), else the job's model.

    Only methods whose server holds no model (no weights travel) may mix architectures; for the others every
    site must train the job's model, because the server averages weights key by key.
    """
    local = SiteFile.of(site_config_dir).get("model")
    chosen = local or (site_models or {}).get(site) or job_model
    if chosen != job_model and get_method(method).server_model:
        where = "its local medflare_site.json" if local else "the job's site_model"
        raise ConfigError(
            f"{site}: {where} asks for model '{chosen}', but '{method}' averages weights, so every site must train "
            f"the job's model '{job_model}'; per-site architectures need a method that sends no weights (e.g. mdhfl)"
        )
    return str(chosen)


def resolve_site_dp(
    job_dp: Mapping[str, Any] | None, site: str, site_config_dir: str | Path | SiteFile | None
) -> dict[str, Any]:
    """The DP-SGD settings this site trains with: the job's ``dp_sgd``, checked against the ``dp_sgd`` policy of
    its own ``local/medflare_site.json`` (which may require DP-SGD, a σ floor, a clipping ceiling, a δ ceiling and
    a budget); {} = off.

    Raises:
        SiteDeclined: the job asks for less than the site demands (one line, sent back to the server).
    """
    policy = SiteFile.of(site_config_dir).get("dp_sgd")
    if not job_dp and not policy:
        return {}
    from medflare.dp_sgd import site_dp_settings  # local: opacus is an extra, needed only when DP-SGD is in play

    cfg = site_dp_settings(job_dp, policy, site)
    return dataclasses.asdict(cfg) if cfg is not None else {}


@dataclass(frozen=True)
class SiteFile:
    """A site's ``local/medflare_site.json``, read once (the executor hands it to every resolver below).

    ``content`` is None when the site has none (FLARE's simulator).
    """

    path: Path
    content: dict[str, Any] | None

    @classmethod
    def of(cls, site: str | Path | SiteFile | None) -> SiteFile:
        """``site`` itself, or the file in the site's ``local/`` folder ``site`` (None: no file).

        Raises:
            DataError: one line naming the file and the field that is not JSON, nested too deep, or of the wrong
                type.
        """
        if isinstance(site, SiteFile):
            return site
        path = Path(site or ".") / SITE_CONFIG_FILE
        if site is None or not path.is_file():
            return cls(path, None)
        from medflare import readback  # local: beside its one use in this module

        fix = 'fix it, e.g. {"data": {"source": "folder:/path"}}'
        # "data" and ALLOW_JOB_DATA are checked where they are used (a missing data object, only true opts in)
        schema = readback.obj(optional={"model": readback.STR, "dp_sgd": readback.OBJECT,
                                        "distributed": readback.OBJECT, "policy": readback.OBJECT})
        return cls(path, readback.check(readback.load_json(path, DataError, fix=fix), schema, str(path), DataError, fix))

    def get(self, key: str, default: Any = None) -> Any:
        return (self.content or {}).get(key, default)


def load_site_data(settings: SiteSettings, site_index: int, site_name: str, pooled_test: bool = False) -> Any:
    """The site's data as the job's task needs it (``medflare.data.SiteData``): the job's class names (with the
    site's ``class_map``), channels and single- or multi-label checked; what a site does when a job arrives and what
    ``medflare preflight --job`` does before one does.

    ``pooled_test``: a trainer that scores its own model on the pooled test set (FCA's generalization without a
    global classifier).

    Raises:
        DataError: the data cannot be read or does not fit the job's task (one line naming the site).
    """
    from medflare.data import DataConfig, make_site_data

    cfg = from_dict(DataConfig, {**settings.data, "num_classes": settings.task.num_classes}, "data")
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
        self.spec = get_method(settings.method)
        check_multi_label_support(self.spec, settings.task)
        self.method_cfg = from_dict(self.spec.config_cls, settings.method_args, f"method '{settings.method}'")
        self.train_cfg = resolve_train_config(self.spec, settings.train)
        self.log = log
        torch.manual_seed(settings.seed + site_index)
        if self.train_cfg.torch_threads > 0:
            torch.set_num_threads(self.train_cfg.torch_threads)
        self.device = get_device()  # CUDA when the site has a GPU, else CPU
        self.data = self._load_data(site_index)
        self.model = self._build_model()
        self.trainer: LocalTrainer = self.spec.trainer_cls(
            self.model, self.data, self.train_cfg, self.method_cfg, self.spec.payload, self.device, log
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
        pooled_test = bool(getattr(self.spec.trainer_cls, "scores_pooled_test", False))
        data = load_site_data(self.settings, site_index, self.site_name, pooled_test)
        self.log(f"{len(data.train)} train / {len(data.val)} val / {len(data.test)} test images")
        return data

    def _build_model(self) -> torch.nn.Module:
        task = self.settings.task
        model = self.spec.build_model(
            self.settings.model, task.num_classes, task.in_channels, task.image_size, None, self.method_cfg
        )
        if self.settings.dp_sgd:  # the architecture the server built for this job (flare.models.build_global_model)
            from medflare.dp_sgd import check_method_supports_dp, dp_compatible_model

            check_method_supports_dp(self.settings.method, self.spec.dp_sgd_blocker)
            model = dp_compatible_model(model)
        return place_model(model, self.device)

    def _enable_dp_sgd(self) -> None:
        """Per-sample clipping, noise and this site's accountant for the whole job (kept in its state file)."""
        from medflare.dp_sgd import DPSGDConfig, PrivateTraining

        cfg = from_dict(DPSGDConfig, self.settings.dp_sgd, "dp_sgd")
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
        others = {k: v for k, v in arrays.items() if k not in self.model_keys}
        return {**encode_weights(weights, received, dtype, kind), **others}

    def _check_outgoing(self, arrays: Mapping[str, Any], meta: Mapping[str, Any], phase: str, ctx: RoundContext) -> None:
        task = self.settings.task
        dims = ctx.server_meta.get(contracts.ARRAY_DIMS) or {}
        contract = ContractContext(task.num_classes, dims=dims, multi_label=task.multi_label)
        self.spec.payload.check_outgoing(arrays, meta, self.model_keys, contract, phase=phase, stage=ctx.stage)

    # ----- state kept at the site ------------------------------------------------------------------
    def save_state(self) -> None:
        """Write the trainer's state (optimizer, private keys, method state) into the site's job workspace.

        The write runs in the background while the result travels (two model sizes of Adam state took up to a
        second per round on a busy disk); every task waits for it before it touches the trainer, so the file
        never mixes two rounds. A site killed within that moment restarts from the previous task's state.
        """
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


def site_index_from_name(site_name: str, sites: list[str] | None) -> int:
    """Position of a site in the job's site list (used to pick its simulated partition)."""
    if sites:
        if site_name not in sites:
            raise ConfigError(f"site '{site_name}' is not in the job's site list {sites}")
        return sites.index(site_name)
    digits = "".join(ch for ch in site_name.rsplit("-", 1)[-1] if ch.isdigit())
    if not digits:
        raise ConfigError(f"cannot derive a partition index from site name '{site_name}'; list the sites in the job")
    return int(digits) - 1
