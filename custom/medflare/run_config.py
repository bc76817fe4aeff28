"""The user-facing run configuration: defaults <- --config file <- command-line flags <- --set overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from medflare.config import from_dict, parse_value
from medflare.errors import ConfigError
from medflare.methods.base import TrainConfig
from medflare.registry import get_method
from medflare.site_runtime import TaskSpec, check_multi_label_support, resolve_train_config

# --set prefixes and the RunConfig field each one writes into
SECTIONS = {"method": "method_args", "train": "train", "data": "data", "task": "task"}


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
        task: {"num_classes", "in_channels", "image_size"[, "multi_label"]}; inferred from the data when not all
            three are given (multi_label too: the data decides whether labels are multi-hot).
        shot_thresholds: (head_min, tail_max) class-count thresholds for head/medium/tail metrics, or None.
        site_train: per-site TrainConfig overrides, e.g. {"site-2": {"batch_size": 16}}.
        site_evaluation: when sites send evaluation counts of the received model: every_round (default),
            final (only the last model), or off. They reveal each site's val/test class counts.
        straggler_seconds: once min_clients sites answered, how long the rest may take before a round goes on.
        task_timeout: seconds a site may spend on one task before it counts as dropped out (0 = no limit).
        task_request_interval: FLARE server polling interval in seconds (2.0 is FLARE's default; 0.1 is faster).
        name: job name (default: the method name).
        site_model: per-site architectures, e.g. {"site-1": "resnet10"}; only for methods whose server holds
            no model (no weights travel).
        robust: server-side defences, {"max_norm_ratio": 10, "max_share": 0.5} (see flare.aggregator.RobustConfig).
        transfer_dtype: float32 (default) or float16: how float weights travel (the server aggregates in float64
            and keeps the global model in its own precision).
        plugins: Python files that register extra methods (``register_method``); they ship inside the job
            (BYOC), so a researcher can run a method without changing medflare.
        transfer_kind: weights (default) or diff: sites send θ_local − θ_global for float keys (integer buffers
            stay at the site), which FLARE's differential-privacy filters need.
        dp: a differential-privacy result filter the job asks every site to apply to its updates, e.g.
            {"filter": "percentile", "args": {"percentile": 10, "gamma": 0.01}} (needs transfer_kind=diff). A
            hospital can also impose one in its own privacy policy.
        audit: record the structure (names, dtypes, shapes, bytes; never values) of every task and result at each
            site into ``medflare_payload_audit.jsonl`` (a privacy review of what really travels).
    """

    method: str = "fedavg"
    model: str = "cnn"
    pretrained: str | None = None
    rounds: int = 3
    clients: int = 2
    min_clients: int = 0
    seed: int = 0
    data: dict[str, Any] = field(default_factory=lambda: {"source": "synthetic", "partition": "iid"})
    train: dict[str, Any] = field(default_factory=dict)
    method_args: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    shot_thresholds: list[int] | None = None
    site_train: dict[str, dict[str, Any]] = field(default_factory=dict)
    site_evaluation: str = "every_round"
    straggler_seconds: int = 600
    task_timeout: int = 0
    task_request_interval: float = 0.1
    name: str = ""
    site_model: dict[str, str] = field(default_factory=dict)
    robust: dict[str, Any] = field(default_factory=dict)
    transfer_dtype: str = "float32"
    plugins: list[str] = field(default_factory=list)
    transfer_kind: str = "weights"
    dp: dict[str, Any] = field(default_factory=dict)
    audit: bool = False

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.clients < 1:
            raise ConfigError("rounds and clients must be >= 1")
        if not 0 <= self.min_clients <= self.clients:
            raise ConfigError(f"min_clients must be between 0 and clients={self.clients}, got {self.min_clients}")

    @property
    def job_name(self) -> str:
        return self.name or self.method

    @property
    def required_clients(self) -> int:
        return self.min_clients or self.clients

    @property
    def site_names(self) -> list[str]:
        return [f"site-{i + 1}" for i in range(self.clients)]

    def validate(self) -> None:
        """Fail before launching anything: unknown method, bad method or train options, stages that do not add
        up to the rounds, per-site models a weight-averaging method cannot use."""
        load_plugin_files(self.plugins)
        spec = get_method(self.method)
        from medflare.flare.aggregator import RoundAggregation

        RoundAggregation(
            self.method, self.method_args, 2, self.rounds, self.robust, self.transfer_dtype, self.transfer_kind
        )
        if self.dp:
            from medflare.flare.privacy import UpdatePrivacy

            if self.transfer_kind != "diff":
                raise ConfigError("dp filters act on weight differences: add --set transfer_kind=diff")
            try:
                UpdatePrivacy(**self.dp)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"dp: {exc}") from exc
        resolve_train_config(spec, self.train)
        if self.task.get("multi_label") or self.data.get("source", "site") != "site":  # else sites' data decide
            check_multi_label_support(spec, self.task_spec())
        for site, overrides in self.site_train.items():
            if site not in self.site_names:
                raise ConfigError(f"site_train names '{site}', which is not one of {self.site_names}")
            resolve_train_config(spec, {**self.train, **overrides})
        from medflare.models import list_models

        for site, model in {"": self.model, **self.site_model}.items():
            if model not in list_models():
                raise ConfigError(f"unknown model '{model}'; available: {', '.join(list_models())}")
            if site and site not in self.site_names:
                raise ConfigError(f"site_model names '{site}', which is not one of {self.site_names}")
        if spec.server_model and any(model != self.model for model in self.site_model.values()):
            raise ConfigError(
                f"'{self.method}' averages weights, so every site trains model '{self.model}'; per-site models "
                "(site_model) need a method that sends no weights"
            )

    def plugin_modules(self) -> list[str]:
        """The module names the job's plugin files have inside the job (``medflare_plugins.<file stem>``)."""
        return [plugin_module_name(path) for path in self.plugins]

    def site_data(self) -> dict[str, Any]:
        """The data config the sites receive (num_sites and seed filled in for simulation)."""
        if self.data.get("source", "site") == "site":
            return {"source": "site"}
        return {"seed": self.seed, **self.data, "num_sites": self.clients}

    def task_spec(self) -> TaskSpec:
        """The declared task; missing fields are read off the data (simulation) or must be given (site data)."""
        declared = {"num_classes", "in_channels", "image_size"} <= set(self.task)
        return TaskSpec(**self.task) if declared else infer_task(self)

    def train_config(self) -> TrainConfig:
        return resolve_train_config(get_method(self.method), self.train)


def infer_task(run: RunConfig) -> TaskSpec:
    """Class count, channels and image size of the (simulation) data source."""
    if run.data.get("source", "site") == "site":
        raise ConfigError(
            "with site-local data the job must declare task.num_classes, task.in_channels and task.image_size "
            "(e.g. --set task.num_classes=2 --set task.in_channels=1 --set task.image_size=28)"
        )
    from medflare.data import load_source

    splits = load_source(run.data["source"], seed=run.seed, num_classes=run.task.get("num_classes"))
    sample = splits.train.get_image(0)
    size = run.data.get("image_size") or int(sample.shape[0])
    inferred = {"num_classes": splits.train.num_classes, "in_channels": splits.train.channels, "image_size": size,
                "multi_label": splits.train.multi_label}
    return TaskSpec(**{**inferred, **run.task})


def apply_overrides(run: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.key=value`` overrides, e.g. ``method.mu=0.1``, ``train.lr=0.01``, ``rounds=5``."""
    changes: dict[str, Any] = {}
    nested = {name: dict(getattr(run, name)) for name in SECTIONS.values()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        section, dot, sub = key.partition(".")
        if dot and section in SECTIONS:
            nested[SECTIONS[section]][sub] = parse_value(raw)
        elif not dot and key in {f.name for f in dataclasses.fields(RunConfig)}:
            changes[key] = parse_value(raw)
        else:
            raise ConfigError(f"--set: unknown key '{key}'; use method.X, train.X, data.X, task.X or a top-level option")
    return from_dict(RunConfig, {**dataclasses.asdict(run), **nested, **changes}, "run config")


def merge_sections(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``; the nested sections (data, train, method_args, task) merge key by key."""
    merged = {**dict(base), **dict(override)}
    for key in SECTIONS.values():
        if key in base and key in override:
            merged[key] = {**base[key], **override[key]}
    return merged


def merge_run_config(base: Mapping[str, Any], flags: Mapping[str, Any]) -> RunConfig:
    """Defaults <- file values <- flags that were given (None means 'not given')."""
    given = {key: value for key, value in flags.items() if value is not None}
    return from_dict(RunConfig, merge_sections(base, given), "run config")


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
