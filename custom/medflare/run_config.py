"""The user-facing run configuration: defaults <- --preset <- scenario <- --config file <- command-line flags <- --set.

``RunConfig.validate`` is the one typed validation every command runs (``run``, ``compare``, ``export`` and the
POC runner) before anything is started or written: every section is checked against its dataclass's
annotations and ranges, and normalised to typed values, so a job never carries ``"0.1"`` where 0.1 is meant.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from medflare.config import MAX_IMAGE_SIZE, check_value, fields_typed, from_dict
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, TrainConfig
from medflare.methods.presets import Preset
from medflare.registry import get_method
from medflare.server_setup import RULE_OPTION_NAMES, RULE_OPTIONS, RobustConfig
from medflare.site_config import TaskSpec, check_dp_filter, check_multi_label_support

if TYPE_CHECKING:
    from medflare.data import DataConfig

# --set prefixes and the RunConfig field each one writes into
SECTIONS = {"method": "method_args", "train": "train", "data": "data", "task": "task", "robust": "robust",
            "dp_sgd": "dp_sgd"}
# A job name becomes a folder name: one plain path component, never a path
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SITE_EVALUATION = ("every_round", "final", "off")
TASK_SHAPE = ("num_classes", "in_channels", "image_size")  # the task fields a job must know (class_names optional)
# Bounds of a run's numbers: beyond them a job is a typo or an attack (a round plan of 10^20 rounds filled memory;
# a seed of 2^64 failed inside FLARE; site indices are added to the seed, and numpy takes seeds below 2^32).
MAX_ROUNDS = 100_000
MAX_CLIENTS = 1_000
MAX_SEED = 2**31 - 1
MAX_SECONDS = 7 * 24 * 3600  # a week: straggler and task limits
TASK_BOUNDS = {"num_classes": (2, 100_000), "in_channels": (1, 16), "image_size": (8, MAX_IMAGE_SIZE)}
IMAGENET = "imagenet"  # the `pretrained` value naming a model's offline ImageNet weights
# The server's defences in every job for a real deployment (POC, production; issue 26), under the run's own robust
# settings. One hospital can neither take over nor break the aggregate: an update more than 10x the other sites'
# median norm is rejected, and no site weighs more than 60 % (feasible with the 2 sites a round needs). Honest sites
# of very different sizes stay well inside both; a forged x1e30 update or n_samples=1e8 does not.
DEPLOY_ROBUST = {"max_norm_ratio": 10.0, "max_share": 0.6}
# Both defences off, as `robust.off=true` writes it: explicit zeros, so a job says "off" instead of omitting it
ROBUST_OFF = {"max_norm_ratio": 0.0, "max_share": 0.0}
ROBUST_OFF_KEY = "off"

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
        task: {"num_classes", "in_channels", "image_size"[, "multi_label"]}, inferred from the data when not all
            three are given (multi_label too: the data decides whether labels are multi-hot), and optionally
            "class_names" (from the data's folder names or CSV class_name column when not given).
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
            or {"off": true} for none. A job for a real deployment (POC, production, a pre-installed or site-data
            export) gets DEPLOY_ROBUST under these settings, which win key by key; the simulator takes them as they
            are, none by default, so research runs aggregate as the papers do (:func:`deployment_robust`).
        transfer_dtype: float32 (default) or float16: how float weights travel from the sites (the server
            aggregates in float64 and keeps the global model in its own precision).
        download_dtype: float32 (default) or float16: how the global model's float weights travel to the sites
            (each site loads them into its model's own dtype; integer buffers travel as they are).
        stream_aggregation: the server adds each site's result to one float64 sum as it arrives (in site-name order,
            so reruns repeat bit for bit) instead of holding every site's copy until the round ends; linear rules
            only, the others aggregate in one batch and each round's record says why (docs/architecture.md).
        plugins: Python files that register extra methods (``register_method``); they ship inside the job
            (BYOC), so a researcher can run a method without changing medflare.
        transfer_kind: weights (default) or diff: sites send θ_local − θ_global for float keys (integer buffers
            stay at the site), which FLARE's differential-privacy filters need.
        dp: a differential-privacy result filter the job asks every site to apply to its updates, e.g.
            {"filter": "percentile", "args": {"percentile": 10, "gamma": 0.01}} (needs transfer_kind=diff). A
            hospital can also impose one in its own privacy policy.
        dp_sgd: DP-SGD at every site (:class:`medflare.dp_sgd.DPSGDConfig`: noise_multiplier, max_grad_norm, delta,
            max_epsilon, accountant), e.g. ``--set dp_sgd.noise_multiplier=1.1``; empty = off. Each site clips and
            noises every sample's gradient, accounts its ε and records it each round; a site's own
            ``medflare_site.json`` may demand more (docs/privacy.md). Needs ``medflare[dp]``.
        audit: record the structure (names, dtypes, shapes, bytes; never values) of every task and result at each
            site into ``medflare_payload_audit.jsonl`` (a privacy review of what really travels).
        tracking: experiment tracking through FLARE's analytics events: tensorboard (default), mlflow, both, or
            off. Without the package on the server a run records nothing and runs on (``medflare[tracking]``).
        patience: stop after this many rounds without a better validation ``balanced_accuracy`` than the best
            model's (0 = never); the final validation still runs. Needs site_evaluation=every_round.
        resume_from: a previous run's folder (``medflare_results.json`` and ``FL_global_model.pt``), read by the
            server: the job continues its round counter, history and global model (``--resume``).
        secure_aggregation: "off" (default) or "he": sites encrypt their model arrays with the TenSEAL CKKS
            context of their kit (FLARE's HEBuilder), the server aggregates ciphertexts with its plaintext
            weights and never reads an update, sites decrypt the global model (POC and production only;
            :mod:`medflare.flare.he`, docs/privacy.md).
    """

    method: str = "fedavg"
    model: str = ""  # "" = the method's default (MethodSpec.default_model: cnn, a ViT for SSL-FL, ...)
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
    download_dtype: str = "float32"
    stream_aggregation: bool = False
    plugins: list[str] = field(default_factory=list)
    transfer_kind: str = "weights"
    dp: dict[str, Any] = field(default_factory=dict)
    dp_sgd: dict[str, Any] = field(default_factory=dict)
    audit: bool = False
    tracking: Literal["tensorboard", "mlflow", "both", "off"] = "tensorboard"
    patience: int = 0
    resume_from: str = ""
    secure_aggregation: Literal["off", "he"] = "off"

    def __post_init__(self) -> None:
        if not self.model:
            load_plugin_files(self.plugins)  # a plugin's method names its default model too
            self.model = get_method(self.method).default_model
        checks = [
            (1 <= self.rounds <= MAX_ROUNDS, f"rounds must be between 1 and {MAX_ROUNDS}, got {self.rounds}"),
            (1 <= self.clients <= MAX_CLIENTS, f"clients must be between 1 and {MAX_CLIENTS}, got {self.clients}"),
            (0 <= self.min_clients <= self.clients,
             f"min_clients must be between 0 and clients={self.clients}, got {self.min_clients}"),
            (0 <= self.seed <= MAX_SEED, f"seed must be between 0 and {MAX_SEED}, got {self.seed}"),
            (self.site_evaluation in SITE_EVALUATION,
             f"site_evaluation must be one of {', '.join(SITE_EVALUATION)}, got '{self.site_evaluation}'"),
            (0 <= self.straggler_seconds <= MAX_SECONDS,
             f"straggler_seconds must be between 0 and {MAX_SECONDS}, got {self.straggler_seconds}"),
            (0 <= self.task_timeout <= MAX_SECONDS,
             f"task_timeout must be between 0 (no limit) and {MAX_SECONDS}, got {self.task_timeout}"),
            (self.task_request_interval > 0, f"task_request_interval must be > 0, got {self.task_request_interval}"),
            (self.shot_thresholds is None or (len(self.shot_thresholds) == 2
                                               and self.shot_thresholds[0] >= self.shot_thresholds[1] >= 0),
             f"shot_thresholds must be [head_min, tail_max], head_min >= tail_max >= 0, got {self.shot_thresholds}"),
            (not self.name or JOB_NAME.fullmatch(self.name) is not None,
             f"name must be a plain job name (letters, digits, '.', '_', '-'; no '/'; at most 64), got '{self.name}'"),
            (self.patience >= 0, f"patience must be >= 0 (0 = no early stopping), got {self.patience}"),
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

    def validate(self, check_files: bool = True, data_defaults: Mapping[str, Any] | None = None) -> None:
        """Check every option against its type and range, and normalise the sections to typed values.

        The one validation ``run``, ``compare``, ``export`` and the POC runner share; it starts nothing and
        writes nothing. Data sources are read later, by :meth:`task_spec`. What needs the method's server rule
        or each site's training settings (the stages add up to the rounds, a robust rule keeps enough sites, the
        method's own ``MethodSpec.check_run``) is checked where those are built, once: :func:`medflare.plan.
        build_plan`, before anything is launched or written. The method's protocol data options
        (``MethodSpec.data_defaults``, e.g. FCA's ``eval_split=like_train``) go into ``data`` here, under the
        job's own (see :meth:`_with_data_defaults`), so the run records them.

        Args:
            check_files: also require the job's data files and folders and a ``pretrained`` weights file to
                exist here (off for ``export``: the machines that read them may be others). Either way they
                become absolute paths (:meth:`_resolve_paths`).
            data_defaults: the protocol data options to apply instead of the method's own (``compare`` gives
                every method the same, :func:`shared_data_defaults`).

        Raises:
            ConfigError: the first problem, in one line naming the option (DataError for a missing data path).
        """
        load_plugin_files(self.plugins)
        spec = get_method(self.method)
        self.method_args = fields_typed(spec.config_cls, self.method_args, "method", f"method '{self.method}'")
        spec.config_cls(**self.method_args)  # the method's own range checks
        self.train = fields_typed(TrainConfig, self.train, "train")
        self.robust = typed_robust(self.robust)  # before the aggregator sees it: it knows no "off"
        if self.secure_aggregation == "he":  # what the server can no longer do with encrypted updates
            from medflare.ops.he_aggregate import check_encrypted_run

            check_encrypted_run(spec, stream_aggregation=self.stream_aggregation, transfer_kind=self.transfer_kind,
                                transfer_dtype=self.transfer_dtype, download_dtype=self.download_dtype,
                                max_norm_ratio=self.robust.get("max_norm_ratio", 0.0), resume=bool(self.resume_from),
                                robust_rule=self.robust.get("rule", "mean"))
        if self.dp:
            if self.transfer_kind != "diff":
                raise ConfigError("dp filters act on weight differences: add --set transfer_kind=diff")
            check_dp_filter(self.dp)
        self._validate_dp_sgd(spec)
        for site, overrides in self.site_train.items():
            if site not in self.site_names:
                raise ConfigError(f"site_train names '{site}', which is not one of {', '.join(self.site_names)}")
            self.site_train[site] = fields_typed(TrainConfig, overrides, f"site_train.{site}")
        self.task = _typed_task(self.task)
        self.data = fields_typed(_data_config_cls(), self.data, "data")
        self.data = self._with_data_defaults(spec.data_defaults if data_defaults is None else data_defaults)
        self._resolve_paths(check_files)
        self.data_config()  # the partition scheme, noise rate, ... ranges
        self._validate_model(check_files)
        if self.resume_from and check_files:  # a folder the simulator's server reads: checked with the plan
            self.resume_from = str(Path(self.resume_from).resolve())

    def _validate_dp_sgd(self, spec: MethodSpec) -> None:
        """The dp_sgd section typed and in range, a method whose update can be DP-SGD, and a model Opacus can train
        (built here once, at a small size, so an unsupported layer is refused before launch)."""
        if not self.dp_sgd:
            return
        from medflare.dp_sgd import DPSGDConfig, check_method_supports_dp, dp_compatible_model

        # every setting written out (δ and the accountant included), so the job and its records say what ran
        self.dp_sgd = dataclasses.asdict(DPSGDConfig(**fields_typed(DPSGDConfig, self.dp_sgd, "dp_sgd")))
        check_method_supports_dp(self.method, spec.dp_sgd_blocker)
        if spec.server_model:  # sites of a method without a server model may train their own architectures
            channels, size = int(self.task.get("in_channels", 1)), int(self.task.get("image_size", 32))
            method_cfg = spec.config_cls(**self.method_args)
            dp_compatible_model(spec.build_model(self.model, 2, channels, size, None, method_cfg))

    def _resolve_paths(self, check_files: bool) -> None:
        """Make every file or folder the job names absolute, against the folder medflare runs in.

        FLARE starts the simulator's server and sites (and a POC's) in workspace folders of their own, so a relative
        ``medmnist:``/``folder:``/``csv:`` source, public set or weights file would pass here and fail at every site
        minutes later. Paths a hospital gives in its own ``local/medflare_site.json`` (``source: site``) are never
        in the job, so they stay as the site wrote them.

        Raises:
            DataError, ConfigError: ``check_files`` and a path names nothing here; one line naming the path.
        """
        from medflare.data.public import absolute_public_source
        from medflare.data.sources import absolute_source

        if self.data.get("source", "site") != "site":
            self.data["source"] = absolute_source(self.data["source"], "data.source", check_files)
        if self.data.get("public_source"):
            self.data["public_source"] = absolute_public_source(self.data["public_source"], check=check_files)
        if self.pretrained not in (None, IMAGENET):
            self.pretrained = os.path.abspath(os.path.expanduser(self.pretrained))

    def _with_data_defaults(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """The run's data options with a method's protocol options under them (simulated data only).

        An option the job sets itself (scenario, file, flag or ``--set data.X``) wins. ``eval_split=like_train``
        follows single class ids, so it is not applied to a multi-label task (the slices stay pooled); a method
        that trains only single-label tasks refuses a multi-label one in :meth:`task_spec` with its own message.
        """
        missing = {key: value for key, value in defaults.items() if key not in self.data}
        if not missing or self.data.get("source", "site") == "site":
            return self.data
        if missing.get("eval_split") == "like_train" and self._multi_label_task():
            missing.pop("eval_split")
        return {**self.data, **fields_typed(_data_config_cls(), missing, "data")}

    def _multi_label_task(self) -> bool:
        """Whether the task is multi-label: as declared, else (a method that can train one) read off the data."""
        if set(TASK_SHAPE) <= set(self.task) or "multi_label" in self.task:
            return bool(self.task.get("multi_label", False))
        if not get_method(self.method).multi_label:
            return False  # task_spec refuses a multi-label task for this method before anything starts
        return infer_task(self).multi_label

    def data_config(self) -> DataConfig:
        """The data the sites receive (:meth:`site_data`), typed and range-checked."""
        return from_dict(_data_config_cls(), self.site_data() if self.simulated else self.data, "data")

    @property
    def simulated(self) -> bool:
        """Whether the job brings its own (simulated) data instead of each site reading its own."""
        return self.data.get("source", "site") != "site"

    def _validate_model(self, check_files: bool) -> None:
        from medflare.models import get_model_info, list_models

        for site, model in {"": self.model, **self.site_model}.items():
            get_model_info(model)  # unknown, or an installed package's model that cannot load: refused before launch
            if site and site not in self.site_names:
                raise ConfigError(f"site_model names '{site}', which is not one of {', '.join(self.site_names)}")
        if get_method(self.method).server_model and any(model != self.model for model in self.site_model.values()):
            raise ConfigError(
                f"'{self.method}' averages weights, so every site trains model '{self.model}'; per-site models "
                "(site_model) need a method that sends no weights"
            )
        if self.pretrained == IMAGENET and get_model_info(self.model).imagenet_weights is None:
            offline = [m for m in list_models() if get_model_info(m).imagenet_weights is not None]
            raise ConfigError(f"pretrained=imagenet: model '{self.model}' has no offline ImageNet weights "
                              f"(only {', '.join(offline)}); use --model {offline[0]} or a weights file")
        if check_files and self.pretrained not in (None, IMAGENET) and not Path(self.pretrained).is_file():
            raise ConfigError(f"--pretrained: weights file '{self.pretrained}' not found (relative paths are read "
                              "from the folder medflare runs in); give an existing file or 'imagenet'")

    def plugin_modules(self) -> list[str]:
        """The module names the job's plugin files have inside the job (``medflare_plugins.<file stem>``)."""
        return [plugin_module_name(path) for path in self.plugins]

    def site_data(self) -> dict[str, Any]:
        """The data config the sites receive: num_sites and seed filled in for simulation; with site data, the
        job's own data options (e.g. ``augment``), which each site takes or refuses
        (``site_config.read_site_data_config``: the hospital's file decides), but not ``partition``, which only
        splits simulated data."""
        if self.data.get("source", "site") == "site":
            return {"source": "site", **{key: value for key, value in self.data.items() if key != "partition"}}
        return {"seed": self.seed, **self.data, "num_sites": self.clients}

    def task_spec(self) -> TaskSpec:
        """The declared task; missing fields are read off the data (simulation) or must be given (site data).

        Raises:
            ConfigError: also when the method cannot train the task (a multi-label task needs a method whose
                MethodSpec says ``multi_label``), so nothing is exported or launched for it.
        """
        declared = set(TASK_SHAPE) <= set(self.task)
        task = TaskSpec(**self.task) if declared else infer_task(self)
        check_multi_label_support(get_method(self.method), task)  # before anything is exported or launched
        return task



def shared_data_defaults(methods: list[str], given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The protocol data options of methods compared on identical data (``compare``): the union of their
    ``MethodSpec.data_defaults``, so e.g. FedAvg beside FCA is scored on FCA's like_train test slices too.

    Args:
        methods: the compared methods.
        given: the job's own data options; these win, so a method's default for one of them is not needed.

    Raises:
        ConfigError: two methods ask for different values of an option the job leaves open.
    """
    shared: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for method in methods:
        for key, value in get_method(method).data_defaults.items():
            if key in (given or {}):
                continue
            if key in shared and shared[key] != value:
                raise ConfigError(f"'{owners[key]}' evaluates with data.{key}={shared[key]} and '{method}' with "
                                  f"{value}; choose one for every method with --set data.{key}=...")
            shared.setdefault(key, value)
            owners.setdefault(key, method)
    return shared


def typed_robust(robust: Mapping[str, Any]) -> dict[str, Any]:
    """The run's own robust settings, typed and range-checked; ``off: true`` becomes both defences at 0.

    Raises:
        ConfigError: an unknown key, a value out of range, an option of a rule the run does not use, or ``off``
            beside a defence it would silently drop.
    """
    settings = dict(robust)
    valid = [field.name for field in dataclasses.fields(RobustConfig)]
    unknown = sorted(set(settings) - {*valid, ROBUST_OFF_KEY})
    if unknown:
        raise ConfigError(f"robust: unknown option(s) {', '.join(unknown)}; valid options: "
                          f"{', '.join([*valid, ROBUST_OFF_KEY])}")
    off = check_value(settings.pop(ROBUST_OFF_KEY, False), bool, f"robust.{ROBUST_OFF_KEY}", True)
    typed = fields_typed(RobustConfig, settings, "robust")
    defences = RobustConfig(**typed)  # the ranges
    unused = sorted(set(typed) & set(RULE_OPTION_NAMES) - set(RULE_OPTIONS.get(defences.rule, ())))
    if unused:
        raise ConfigError(f"robust.{unused[0]} is an option of another rule than robust.rule={defences.rule} "
                          f"(it takes {', '.join(RULE_OPTIONS.get(defences.rule, ())) or 'no options'})")
    kept_on = [f"robust.{key}={typed[key]:g}" for key in ROBUST_OFF if typed.get(key)]
    kept_on += [f"robust.rule={defences.rule}"] if defences.rule != "mean" else []
    if off and kept_on:
        raise ConfigError(f"robust.off=true turns every defence off, but {' and '.join(kept_on)} keeps one on; "
                          "drop one of the two")
    return dict(ROBUST_OFF) if off else typed


def deployment_robust(robust: Mapping[str, Any], encrypted: bool = False) -> dict[str, float]:
    """The robust settings of a job for a real deployment: :data:`DEPLOY_ROBUST` under the run's own settings.

    The run's keys win one by one (``robust.max_share=0.4`` keeps the norm bound), so a defence is off only where
    the run says so (``robust.off=true``, or a key set to 0), never because a setting was left out. An
    ``encrypted`` job (secure_aggregation=he) defaults the norm bound to off: the server cannot read the updates
    (the share cap stays: it bounds the server's own plaintext weights).
    """
    defaults = {**DEPLOY_ROBUST, "max_norm_ratio": 0.0} if encrypted else DEPLOY_ROBUST
    return {**defaults, **typed_robust(robust)}


def _data_config_cls() -> type:
    from medflare.data import DataConfig

    return DataConfig


def _typed_task(task: Mapping[str, Any]) -> dict[str, Any]:
    """The declared task fields, typed, with their ranges checked."""
    typed = fields_typed(TaskSpec, dict(task), "task")
    for key, (low, high) in TASK_BOUNDS.items():
        if key in typed and not low <= typed[key] <= high:
            raise ConfigError(f"task.{key} must be between {low} and {high}, got {typed[key]}")
    names = typed.get("class_names")
    if names is not None and "num_classes" in typed and len(names) != typed["num_classes"]:
        raise ConfigError(f"task.class_names lists {len(names)} names for task.num_classes={typed['num_classes']}; "
                          "give one name per class")
    if names is not None and len(set(names)) != len(names):
        raise ConfigError(f"task.class_names has a repeated name: {names}; give each class its own name")
    return typed


def infer_task(run: RunConfig) -> TaskSpec:
    """Class count, channels and image size of the (simulation) data source; declared fields must agree."""
    if run.data.get("source", "site") == "site":
        raise ConfigError(
            "with site-local data the job must declare task.num_classes, task.in_channels and task.image_size "
            "(e.g. --set task.num_classes=2 --set task.in_channels=1 --set task.image_size=28)"
        )
    from medflare.data import load_source
    from medflare.data.readers import parse_window

    splits = load_source(run.data["source"], seed=run.seed, num_classes=run.task.get("num_classes"))
    sample = splits.train.get_image(0)
    if run.data.get("window") and not splits.train.in_memory:  # before launch, not inside the job at every site
        dataclasses.replace(splits.train, window=parse_window(run.data["window"])).get_image(0)
    size = run.data.get("image_size") or int(sample.shape[0])
    inferred = {"num_classes": splits.train.num_classes, "in_channels": splits.train.channels, "image_size": size,
                "multi_label": splits.train.multi_label}
    for key, declared in run.task.items():
        if key in inferred and declared != inferred[key]:
            fix = "data.image_size" if key == "image_size" else "the data source"
            raise ConfigError(f"task.{key}={declared} but the data '{run.data['source']}' gives {key}={inferred[key]}; "
                              f"fix task.{key} or {fix}")
    named = splits.info["class_names"] if splits.info.get("named_classes") else None
    declared_names = run.task.get("class_names")
    if declared_names is not None and named is not None and list(declared_names) != list(named):
        raise ConfigError(f"task.class_names={list(declared_names)} but the data '{run.data['source']}' names its "
                          f"classes {named} (in label order); drop task.class_names or fix it")
    if declared_names is not None and len(declared_names) != inferred["num_classes"]:
        raise ConfigError(f"task.class_names lists {len(declared_names)} names but the data has "
                          f"{inferred['num_classes']} classes; give one name per class")
    return TaskSpec(**inferred, class_names=list(declared_names or splits.info["class_names"]))


def apply_overrides(run: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.key=value`` overrides, e.g. ``method.mu=0.1``, ``train.lr=0.01``, ``rounds=5``.

    Values stay text here; each is parsed by its field's annotation (``from_dict`` for top-level options,
    :meth:`RunConfig.validate` for the sections), so a value that does not fit fails with the option's name.
    """
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
    """``override`` on top of ``base``; the nested sections (data, train, method_args, task, robust) merge key by
    key."""
    merged = {**dict(base), **dict(override)}
    for key in SECTIONS.values():
        if isinstance(base.get(key), Mapping) and isinstance(override.get(key), Mapping):
            merged[key] = {**base[key], **override[key]}
    return merged


def find_preset(name: str, method: str, lead: str | None = None) -> tuple[str, Preset, bool]:
    """The preset ``name`` a run of ``method`` takes: its own, else (``compare``) that of ``lead``, a compared method
    that has one, without ``lead``'s own hyperparameters.

    Returns:
        (the method whose preset it is, the preset, whether ``method`` takes only its shared part).

    Raises:
        ConfigError: neither has a preset of that name; one line naming the methods that do.
    """
    from medflare.registry import list_methods

    for owner in (method, lead):
        if owner and name in get_method(owner).presets:
            return owner, get_method(owner).presets[name], owner != method
    having = [m for m in list_methods() if name in get_method(m).presets]
    known = sorted({p for m in list_methods() for p in get_method(m).presets})
    offer = f"methods with a '{name}' preset: {', '.join(having)}" if having else \
        f"known presets: {', '.join(known) or 'none'}"
    raise ConfigError(f"--preset {name}: method '{method}' has no preset '{name}'; {offer}")


def preset_layer(name: str | None, method: str, lead: str | None = None) -> dict[str, Any]:
    """The run-config layer of ``--preset name`` for ``method`` (empty without one): the lowest layer, under the
    scenario, the config file, the flags and ``--set``, so every value it sets can still be changed.

    A method compared with ``lead`` (``compare fedmas bsm-fl --preset paper``) that has no preset of its own takes
    ``lead``'s shared settings (model, resolution, rounds, clients, training), not ``lead``'s hyperparameters.
    """
    if not name:
        return {}
    _, preset, shared_only = find_preset(name, method, lead)
    layer = preset.shared() if shared_only else dict(preset.overrides)
    return copy.deepcopy(layer)


def merge_run_config(*layers: Mapping[str, Any]) -> RunConfig:
    """RunConfig defaults <- each layer in turn (scenario, file, flags); ``None`` values mean 'not given'.

    Sections merge key by key on top of the defaults, so ``--partition`` alone keeps the default data source.
    """
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
