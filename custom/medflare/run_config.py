"""The user-facing run configuration, as layered: defaults <- --preset <- scenario <- --config file <- command-line
flags <- --set. Plain input (no torch, no method looked up): :func:`medflare.plan.validated` checks it against the
method and types every section, once, and :func:`medflare.plan.build_plan` resolves it into the job's plan.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from medflare.catalog import default_model
from medflare.config import (
    MAX_CLIENTS,
    MAX_ROUNDS,
    MAX_SECONDS,
    MAX_SEED,
    bounded,
    check_fields,
    from_dict,
)
from medflare.errors import ConfigError

if TYPE_CHECKING:
    from medflare.data import DataConfig

# --set prefixes and the RunConfig field each one writes into
SECTIONS = {"method": "method_args", "train": "train", "data": "data", "task": "task", "robust": "robust",
            "dp_sgd": "dp_sgd", "server_optimizer": "server_optimizer"}
# A job name becomes a folder name: one plain path component, never a path
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SITE_EVALUATION = ("every_round", "final", "off")
TASK_SHAPE = ("num_classes", "in_channels", "image_size")  # the task fields a job must know (class_names optional)
MAX_POLL_SECONDS = 60.0  # task_request_interval: FLARE's default is 2; a minute between polls is already slow
# a job name's words, where a refusal says what it must be
JOB_NAME_WORDS = "a plain job name (letters, digits, '.', '_', '-'; no '/'; at most 64)"
IMAGENET = "imagenet"
Tracking = Literal["tensorboard", "mlflow", "both", "off"]
SecureAggregation = Literal["off", "he"]
# medflare.ops.wire's DTYPES and KINDS (not imported: medflare.ops pulls in torch; tests/test_bounds.py keeps them one)
WireDtype = Literal["float32", "float16"]
WireKind = Literal["weights", "diff"]  # the `pretrained` value naming a model's offline ImageNet weights

# run option ``tracking`` -> the receivers it puts on the server (:mod:`medflare.flare.tracking`)
TRACKERS = {"tensorboard": ("tensorboard",), "mlflow": ("mlflow",), "both": ("tensorboard", "mlflow"), "off": ()}
# receiver -> (the package it needs, the medflare class a job names)
RECEIVERS = {
    "tensorboard": ("tensorboard", "medflare.flare.tb_receiver.TensorBoardReceiver"),
    "mlflow": ("mlflow", "medflare.flare.mlflow_receiver.MlflowReceiver"),
}


@dataclass
class RunConfig:
    """Everything one federated job needs.

    Attributes:
        method: registered method name.
        model: model factory name.
        pretrained: None, "imagenet" (efficientnet_lite0 only) or a local weights file, loaded on the server.
        rounds: federated rounds.
        clients: number of sites (simulation and POC).
        min_clients: valid updates a round needs (0 = all sites).
        seed: seed for data generation, partitioning and model init.
        data: DataConfig fields for simulated sites; {"source": "site"} makes each site read its own config.
        train: TrainConfig overrides.
        method_args: the method's hyperparameters.
        task: {"num_classes", "in_channels", "image_size"[, "multi_label", "class_names"]}, read off the data
            when not all three are given (multi_label, and class_names from folder names or a CSV class_name column).
        shot_thresholds: [head_min, tail_max] for head/medium/tail metrics, by each class's total training count
            n: head if n > head_min, tail if n < tail_max (both exclusive), medium otherwise (inclusive), or None.
        site_train: per-site TrainConfig overrides, e.g. {"site-2": {"batch_size": 16}}.
        site_evaluation: when sites send evaluation counts of the received model: every_round (default),
            final (only the last model), or off. They reveal each site's val/test class counts.
        straggler_seconds: once min_clients sites answered, how long the rest may take before a round goes on.
        task_timeout: seconds a site may spend on one task before it counts as dropped out (0 = no limit).
        task_request_interval: FLARE server polling interval in seconds (2.0 is FLARE's default; 0.1 is faster).
        name: job name (default: the method name).
        site_model: per-site architectures, e.g. {"site-1": "resnet10"}; only for methods whose server holds
            no model (no weights travel).
        robust: the server's defences, e.g. {"max_norm_ratio": 10, "max_share": 0.5} (server_setup.RobustConfig),
            or {"off": true}. A deployed job (POC, production, pre-installed or site-data export) gets
            server_setup.DEPLOY_ROBUST under these, key by key; the simulator takes them as given (none by
            default), so research runs aggregate as the papers do.
        transfer_dtype: float32 (default) or float16 for float weights sent by sites (the server aggregates in
            float64 and keeps the global model in its own precision).
        download_dtype: float32 (default) or float16 for the global model's float weights sent to sites (each
            loads them into its model's dtype; integer buffers travel as they are).
        stream_aggregation: the server adds each result to one float64 sum as it arrives (in site-name order, so
            reruns repeat bit for bit) instead of holding every copy; linear rules only, the others aggregate in
            one batch and each round's record says why (docs/architecture.md).
        plugins: Python files that register extra methods (``register_method``), shipped inside the job (BYOC).
        transfer_kind: weights (default) or diff: sites send θ_local − θ_global for float keys (integer buffers
            stay at the site), which FLARE's differential-privacy filters need.
        dp: a differential-privacy result filter every site applies to its updates, e.g. {"filter": "percentile",
            "args": {"percentile": 10, "gamma": 0.01}} (needs transfer_kind=diff); a hospital's privacy policy may
            also impose one.
        dp_sgd: DP-SGD at every site (:class:`medflare.dp_sgd.DPSGDConfig`), e.g. ``--set
            dp_sgd.noise_multiplier=1.1``; empty = off. Each site clips and noises per-sample gradients and records
            its ε each round; its ``medflare_site.json`` may demand more (docs/privacy.md). Needs ``medflare[dp]``.
        audit: record the structure (names, dtypes, shapes, bytes; never values) of every task and result at each
            site into ``medflare_payload_audit.jsonl`` (a privacy review of what really travels).
        tracking: experiment tracking through FLARE's analytics events: tensorboard (default), mlflow, both, or
            off. Without the package on the server a run records nothing and runs on (``medflare[tracking]``).
        patience: stop after this many rounds without a better validation ``balanced_accuracy`` than the best
            model's (0 = never); the final validation still runs. Needs site_evaluation=every_round.
        resume_from: a previous run's folder (``medflare_results.json`` and ``FL_global_model.pt``), read by the
            server: the job continues its round counter, history and global model (``--resume``).
        secure_aggregation: "off" (default) or "he": sites encrypt their arrays with their kit's TenSEAL CKKS
            context (FLARE's HEBuilder); the server aggregates ciphertexts and never reads an update (POC and
            production only; :mod:`medflare.flare.he`, docs/privacy.md).
        server_optimizer: a server optimizer stepping the global model on the pseudo-gradient (aggregate − global
            model) after the bounded aggregate (:class:`medflare.ops.server_opt.ServerOptConfig`), e.g. ``--set
            server_optimizer.name=fedadam``; empty = none (docs/server-optimizers.md).
    """

    method: str = bounded("fedavg", checked_by="the method registry")
    # "" = the method's default (MethodSpec.default_model: cnn, a ViT for SSL-FL, ...)
    model: str = bounded("", checked_by="the model registry")
    pretrained: str | None = bounded(None, checked_by="'imagenet' or an existing weights file")
    rounds: int = bounded(3, low=1, high=MAX_ROUNDS)
    clients: int = bounded(2, low=1, high=MAX_CLIENTS)
    min_clients: int = bounded(0, low=0, high=MAX_CLIENTS, zero="all sites")
    seed: int = bounded(0, low=0, high=MAX_SEED)
    data: dict[str, Any] = field(default_factory=lambda: {"source": "synthetic", "partition": "iid"})
    train: dict[str, Any] = field(default_factory=dict)
    method_args: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    shot_thresholds: list[int] | None = bounded(None, low=0, high=10**9, items=2)
    # site name -> TrainConfig options (typed as train.*): the names checked against the job's sites
    site_train: dict[str, dict[str, Any]] = bounded({}, checked_by="the job's site names")
    site_evaluation: str = bounded("every_round", choices=SITE_EVALUATION)
    straggler_seconds: int = bounded(600, low=0, high=MAX_SECONDS)
    task_timeout: int = bounded(0, low=0, high=MAX_SECONDS, zero="no limit")
    task_request_interval: float = bounded(0.1, low=0, high=MAX_POLL_SECONDS, low_open=True)
    name: str = bounded("", pattern=f"(?:{JOB_NAME.pattern})?", words=JOB_NAME_WORDS)
    site_model: dict[str, str] = bounded({}, checked_by="the model registry and the job's site names")
    robust: dict[str, Any] = field(default_factory=dict)
    transfer_dtype: WireDtype = "float32"
    download_dtype: WireDtype = "float32"
    stream_aggregation: bool = False
    plugins: list[str] = bounded([], checked_by="existing plugin files")
    transfer_kind: WireKind = "weights"
    dp: dict[str, Any] = field(default_factory=dict)
    dp_sgd: dict[str, Any] = field(default_factory=dict)
    audit: bool = False
    tracking: Tracking = "tensorboard"
    patience: int = bounded(0, low=0, high=MAX_ROUNDS, zero="no early stopping")
    resume_from: str = bounded("", checked_by="the previous run's folder")
    secure_aggregation: SecureAggregation = "off"
    server_optimizer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = self.model or default_model(self.method)
        check_fields(self)  # the bounds of each option (the ones medflare_plan.json is read with)
        checks = [
            (self.min_clients <= self.clients,
             f"min_clients must be between 0 and clients={self.clients}, got {self.min_clients}"),
            (self.shot_thresholds is None or (len(self.shot_thresholds) == 2
                                               and self.shot_thresholds[0] >= self.shot_thresholds[1] >= 0),
             f"shot_thresholds must be [head_min, tail_max], head_min >= tail_max >= 0, got {self.shot_thresholds}"),
            (not self.patience or self.site_evaluation == "every_round",
             f"patience needs the sites' validation scores every round: site_evaluation=every_round, got "
             f"'{self.site_evaluation}'"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def job_name(self) -> str:
        return self.name or self.method

    @property
    def required_clients(self) -> int:
        return self.min_clients or self.clients

    @property
    def site_names(self) -> list[str]:
        return [f"site-{i + 1}" for i in range(self.clients)]

    def plugin_modules(self) -> list[str]:
        """The module names the job's plugin files have inside the job (``medflare_plugins.<file stem>``)."""
        return [plugin_module_name(path) for path in self.plugins]

    def site_data(self) -> dict[str, Any]:
        """The data config the sites receive: num_sites and seed filled in for simulation; with site data, the
        job's options (which each site's file takes or refuses) without ``partition``."""
        if self.data.get("source", "site") == "site":
            return {"source": "site", **{key: value for key, value in self.data.items() if key != "partition"}}
        return {"seed": self.seed, **self.data, "num_sites": self.clients}

    def data_config(self) -> DataConfig:
        """The data the sites receive (:meth:`site_data`), typed and range-checked."""
        from medflare.site_config import typed_data_config

        return typed_data_config(self.site_data() if self.simulated else self.data)

    @property
    def simulated(self) -> bool:
        """Whether the job brings its own (simulated) data instead of each site reading its own."""
        return self.data.get("source", "site") != "site"


def apply_overrides(run: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.key=value`` overrides, e.g. ``method.mu=0.1``, ``rounds=5``; values stay text, parsed by
    their field's type (``from_dict`` here, :func:`medflare.plan.validated` for the sections)."""
    changes: dict[str, Any] = {}
    nested = {name: dict(getattr(run, name)) for name in SECTIONS.values()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value (e.g. --set rounds=5), got '{item}'")
        section, dot, sub = key.partition(".")
        if dot and section in SECTIONS and sub:
            nested[SECTIONS[section]][sub] = raw
        elif not dot and key in {f.name for f in dataclasses.fields(RunConfig)}:
            changes[key] = raw
        else:
            raise ConfigError(f"--set: unknown key '{key}'; use method.X, train.X, data.X, task.X, robust.X or a "
                              f"top-level option ({', '.join(f.name for f in dataclasses.fields(RunConfig))})")
    return from_dict(RunConfig, {**dataclasses.asdict(run), **nested, **changes}, "")


def merge_sections(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``; the nested sections merge key by key."""
    merged = {**dict(base), **dict(override)}
    for key in SECTIONS.values():
        if isinstance(base.get(key), Mapping) and isinstance(override.get(key), Mapping):
            merged[key] = {**base[key], **override[key]}
    return merged


def merge_run_config(*layers: Mapping[str, Any]) -> RunConfig:
    """RunConfig defaults <- each layer in turn, sections key by key; ``None`` values mean 'not given'."""
    # model "" until the last layer has named the method, so the default is that method's (MethodSpec.default_model)
    merged: dict[str, Any] = {**dataclasses.asdict(RunConfig()), "model": ""}
    for layer in layers:
        merged = merge_sections(merged, {key: value for key, value in layer.items() if value is not None})
    return from_dict(RunConfig, merged, "")


def plugin_module_name(path: str | Path) -> str:
    """``medflare_plugins.<stem>`` for a plugin file."""
    from medflare.registry import PLUGIN_PACKAGE

    stem = Path(path).stem
    if not stem.isidentifier():
        raise ConfigError(f"plugin file name '{Path(path).name}' must be a valid Python module name")
    return f"{PLUGIN_PACKAGE}.{stem}"


def load_plugin_files(paths: list[str]) -> None:
    """Import plugin files here (under the names they will have inside the job) so their methods register."""
    import importlib.util
    import sys

    for path in paths:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"plugin file not found: {file}")
        name = plugin_module_name(file)
        if name in sys.modules:
            continue
        module_spec = importlib.util.spec_from_file_location(name, file)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise ConfigError(f"plugin {file} failed to load: {exc}") from exc
