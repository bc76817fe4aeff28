"""The run plan: what one job will do, resolved once from the layered :class:`RunConfig` and its task.

The one resolver of a run (the only module that looks a method up by name and types its arguments): :func:`resolve`
checks a copy of the run (:func:`validated`), reads its task (:func:`task_of`) and builds the typed, complete
:class:`RunPlan` (:func:`build_plan`), which is all a runner, the job writer and the outputs take. A job carries it
as ``app/config/medflare_plan.json``; every medflare component reads only that file (:func:`read_plan`), and a site
localises it with its ``medflare_site.json`` (:meth:`RunPlan.localise`). Nothing here imports FLARE's glue
(``medflare.flare``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from medflare.advisories import installed_nvflare
from medflare.config import MAX_CLIENTS, MAX_ROUNDS, bounded, check_fields, fields_typed, from_dict, same_bound
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, RoundContext, Stage, TrainConfig
from medflare.ops.server_opt import (
    ServerOptConfig,
    check_server_optimizer,
    typed_server_optimizer,
    written_server_optimizer,
)
from medflare.registry import get_method, list_methods, load_plugins
from medflare.run_config import (
    IMAGENET,
    JOB_NAME,
    JOB_NAME_WORDS,
    TASK_SHAPE,
    RunConfig,
    SecureAggregation,
    Tracking,
    WireDtype,
    WireKind,
    load_plugin_files,
)
from medflare.server_setup import (
    GlobalNetwork,
    RobustConfig,
    deployment_robust,
    global_model,
    round_plan,
    server_rule,
    typed_robust,
)
from medflare.site_config import (
    MAX_CLASSES,
    SiteFile,
    SiteSettings,
    TaskSpec,
    check_dp_filter,
    check_multi_label_support,
    read_site_data_config,
    resolve_site_dp,
    resolve_site_model,
    resolve_train_config,
    site_index_from_name,
)

if TYPE_CHECKING:
    from torch import nn

    from medflare.dp_sgd import DPSGDConfig
    from medflare.methods.presets import Preset
    from medflare.site_config import DPFilter

# Seconds a site may take for one task when the run sets no task_timeout. FLARE's own default (no limit) let
# one dead site keep a job RUNNING forever; with a limit the site counts as failed for that round.
DEFAULT_TASK_TIMEOUT = 3600
APP_NAME = "app"  # the one app of a job, deployed to every participant
ENCRYPTED_AGGREGATOR = "medflare.flare.he.EncryptedAggregator"  # the aggregator of secure_aggregation=he
PLAN_FILE = "medflare_plan.json"  # in the app's config folder: the job's plan, what every component reads
PLAN_SCHEMA = 1  # of PLAN_FILE; a plan of another schema is refused with the reason


@dataclass(frozen=True)
class SitePlan:
    """One site: its architecture and training settings (method defaults < job options < the site's override)."""

    name: str = bounded(checked_by="the job's site names (FLARE's client names)")
    model: str = same_bound(RunConfig, "model")
    train: TrainConfig = dataclasses.field()


@dataclass(frozen=True)
class RoundPlan:
    """One round: its stage, whether sites score it, and the phases (tasks) the server sends, in order."""

    round: int = bounded(low=0, high=MAX_ROUNDS, high_open=True)
    stage: str = bounded(checked_by="the method's stages (build_plan)")
    scored: bool = dataclasses.field()
    phases: tuple[str, ...] = bounded(checked_by="the method's server rule (build_plan)")


@dataclass(frozen=True)
class RunPlan:
    """Everything a job does, resolved (see the module's doc)."""

    job_name: str = bounded(pattern=JOB_NAME.pattern, words=JOB_NAME_WORDS)
    method: str = same_bound(RunConfig, "method")
    method_args: dict[str, Any] = dataclasses.field()  # every hyperparameter of the method, typed, defaults filled in
    model: str = same_bound(RunConfig, "model")  # the server's (global) model; each site's is in ``sites``
    pretrained: str | None = same_bound(RunConfig, "pretrained")
    seed: int = same_bound(RunConfig, "seed")
    task: TaskSpec
    data: dict[str, Any]  # what the sites receive ({"source": "site"}: each reads its own)
    train: TrainConfig  # the method's defaults under the job's options: a site the plan does not name trains so
    sites: tuple[SitePlan, ...] = bounded(items=MAX_CLIENTS)  # the named sites, each with its own options
    min_clients: int = bounded(low=1, high=MAX_CLIENTS)  # valid updates a round needs
    rounds: tuple[RoundPlan, ...] = bounded(items=MAX_ROUNDS)
    evaluation: str = same_bound(RunConfig, "site_evaluation")
    patience: int = same_bound(RunConfig, "patience")
    straggler_seconds: int = same_bound(RunConfig, "straggler_seconds")
    task_timeout: int = same_bound(RunConfig, "task_timeout")  # effective: DEFAULT_TASK_TIMEOUT when the run sets none
    task_request_interval: float = same_bound(RunConfig, "task_request_interval")
    resume_from: str = same_bound(RunConfig, "resume_from")
    robust: dict[str, Any]  # as the job carries it (deployment defaults under the run's own in a deployed job)
    transfer_dtype: WireDtype = dataclasses.field()
    download_dtype: WireDtype = dataclasses.field()
    transfer_kind: WireKind = dataclasses.field()
    stream_aggregation: bool = dataclasses.field()
    dp: dict[str, Any] = dataclasses.field()
    dp_sgd: dict[str, Any] = dataclasses.field()
    secure_aggregation: SecureAggregation = dataclasses.field()
    audit: bool = dataclasses.field()
    tracking: Tracking = dataclasses.field()
    plugins: tuple[str, ...] = bounded(checked_by="the job's plugin modules (imported by read_plan)")
    # head/medium/tail class ids for long-tail metrics
    shot_groups: dict[str, list[int]] | None = bounded(None, low=0, high=MAX_CLASSES, high_open=True,
                                                       checked_by="the group names medflare.metrics writes")
    # the server optimizer's options as typed (empty: none); left out of the record when empty, so a plan written
    # before it existed reads (and fingerprints) the same
    server_optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the FLARE release the plan was resolved (the job exported) with: a participant on another one warns
    # (medflare.advisories); left out of the record when empty, as in a plan written before it existed
    nvflare: str = bounded("", pattern=r"[0-9A-Za-z.+!_-]{0,40}", words="a FLARE release such as 2.9.0")
    if TYPE_CHECKING:  # what consumers take, typed once per plan from its record (not fields: a replace re-types)
        method_cfg: Any  # the method's config object (``method_args`` is its record)
        defences: RobustConfig  # ``robust`` as the server's defences
        server_opt: ServerOptConfig  # ``server_optimizer`` as the server steps with it
        dp_sgd_cfg: DPSGDConfig | None  # ``dp_sgd`` as every site's DP-SGD starts from it (None: off)
        dp_filter: DPFilter | None  # ``dp`` as the sites' UpdatePrivacy result filter runs it (None: none)

    def __post_init__(self) -> None:
        method_cfg = from_dict(self.spec.config_cls, dict(self.method_args), f"{PLAN_FILE}: method '{self.method}'")
        object.__setattr__(self, "method_cfg", method_cfg)
        object.__setattr__(self, "method_args", dataclasses.asdict(method_cfg))
        object.__setattr__(self, "robust", typed_robust(self.robust))
        object.__setattr__(self, "defences", RobustConfig(**self.robust))
        object.__setattr__(self, "server_optimizer", typed_server_optimizer(self.server_optimizer))
        object.__setattr__(self, "server_opt", ServerOptConfig(**self.server_optimizer))
        check_server_optimizer(self.server_opt, self.method, self.spec.server_model,
                               self.secure_aggregation == "he")
        check_fields(self, PLAN_FILE)
        type_sections(self)
        if not self.sites or not self.model:
            raise ConfigError(f"the plan names no {'model' if self.sites else 'site'} (build it with plan.resolve)")
        if not 1 <= self.min_clients <= len(self.sites):
            raise ConfigError(f"min_clients must be between 1 and the plan's {len(self.sites)} sites, got "
                              f"{self.min_clients}")
        self.defences.check_quorum(self.min_clients, len(self.sites))  # at export and wherever a plan is read
        if not self.rounds or [r.round for r in self.rounds] != list(range(len(self.rounds))):
            raise ConfigError("the plan's rounds must be numbered 0, 1, ... in order")
        check_multi_label_support(self.spec, self.task, multi_label_methods())

    @property
    def spec(self) -> MethodSpec:
        """The registered method this plan runs."""
        return get_method(self.method)

    def round_contexts(self) -> tuple[RoundContext, ...]:
        """The job's rounds as the server runs them (``rounds``): each round's context with its stage's own counters
        (``stage_round`` restarts with each stage); the phases each sends are ``rounds[i].phases``."""
        stages = [Stage(name, len(steps), steps[0].scored)
                  for name, steps in ((name, list(group)) for name, group in groupby(self.rounds, lambda r: r.stage))]
        return tuple(round_plan(stages, len(self.rounds)))

    @property
    def network(self) -> GlobalNetwork:
        """What the job's initial global network is built from (``server_setup.global_model`` takes it)."""
        task = self.task
        return GlobalNetwork(self.spec, self.method_cfg, self.model, task.num_classes, task.in_channels,
                             task.image_size, self.pretrained, self.seed, bool(self.dp_sgd))

    def site(self, name: str) -> SitePlan:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(f"no site '{name}' in the plan; its sites: {', '.join(s.name for s in self.sites)}")

    def localise(self, site: str, site_file: SiteFile, simulated: bool) -> tuple[SiteSettings, int]:
        """What ``site`` runs of this plan, with what only its own ``medflare_site.json`` decides (data, DP-SGD,
        architecture), and the index of its partition of the job's simulated data (0 when it reads its own).
        ``simulated``: the simulator's sites take the job's data."""
        settings = SiteSettings(
            spec=self.spec, task=self.task, data=read_site_data_config(site_file, self.data, simulated),
            model=resolve_site_model(self.spec, self.model, {s.name: s.model for s in self.sites}, site, site_file),
            method_args=self.method_cfg, train=self.site_train(site), seed=self.seed, evaluation=self.evaluation,
            dp_sgd=resolve_site_dp(self.dp_sgd_cfg, site, site_file))
        index = 0 if settings.data.get("local") else site_index_from_name(site, [s.name for s in self.sites])
        return settings, index

    @property
    def max_local_epochs(self) -> int:
        """The most local epochs any site of the plan trains a round (a bound of values summed over epochs)."""
        return max([self.train.local_epochs, *(named.train.local_epochs for named in self.sites)])

    def site_train(self, site: str) -> TrainConfig:
        """The training settings of ``site``: its own in the plan, else the job's (a hospital's own name)."""
        return next((named.train for named in self.sites if named.name == site), self.train)

    def digest(self) -> str:
        """A short fingerprint of the plan: the server and every site log it, so one look shows they run one job."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (the TrainConfigs as dicts; ``method_cfg``, ``defences`` and ``server_opt`` are read off
        the record); an empty ``server_optimizer`` is left out."""
        record = json.loads(json.dumps(dataclasses.asdict(self)))
        for name in ("server_optimizer", "nvflare"):
            if not record[name]:
                del record[name]
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], where: str = PLAN_FILE) -> RunPlan:
        """The plan :meth:`to_dict` wrote, every value typed (the method's arguments against its config class,
        which fills in none: a plan lists them all, and ``method_args`` is their typed record). Raises ConfigError
        (one line) for an unknown or ill-typed option or an unregistered method."""
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in record
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{where}: the plan lacks {', '.join(missing)} (export the job again)")
        return from_dict(cls, dict(record), where)

    def describe(self) -> str:
        """The plan as indented JSON (``medflare config --plan``)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"


def type_sections(plan: RunPlan) -> None:
    """The plan's sections typed once, where the plan is built or read, and held to the bounds of the config they
    become at a site, so an edited ``medflare_plan.json`` is refused before any training: ``data`` (its options
    typed in place: each site's own file completes them), ``dp`` as ``dp_filter`` and ``dp_sgd`` as ``dp_sgd_cfg``
    (their records stay as written)."""
    object.__setattr__(plan, "data", fields_typed(_data_config_cls(), dict(plan.data), f"{PLAN_FILE}.data"))
    object.__setattr__(plan, "dp_filter", check_dp_filter(plan.dp) if plan.dp else None)
    dp_sgd_cfg = None
    if plan.dp_sgd:
        from medflare.dp_sgd import DPSGDConfig

        dp_sgd_cfg = DPSGDConfig(**fields_typed(DPSGDConfig, dict(plan.dp_sgd), f"{PLAN_FILE}.dp_sgd"))
    object.__setattr__(plan, "dp_sgd_cfg", dp_sgd_cfg)


# ----- the resolver: a layered run checked against its method, its task, the plan ---------------------------------
def method_of(run: RunConfig | str, plugins: list[str] | None = None) -> MethodSpec:
    """The registered method a run (or a name) names, its plugins imported first."""
    if isinstance(run, RunConfig):
        load_plugin_files(run.plugins)
        return get_method(run.method)
    load_plugins(plugins or [])
    return get_method(run)


def multi_label_methods() -> list[str]:
    """The registered methods that train multi-label tasks (named when a method cannot)."""
    return [name for name in list_methods() if get_method(name).multi_label]


def validated(run: RunConfig, check_files: bool = True, data_defaults: Mapping[str, Any] | None = None) -> RunConfig:
    """A copy of ``run`` with every option checked against its type, range and method, every section typed (what
    needs the server rule or the sites' settings: :func:`build_plan`). Raises ConfigError, one line naming the
    option (DataError for a missing data path). ``check_files``: also require the data paths and ``pretrained``
    file here (off for ``export``; either way they become absolute). ``data_defaults``: protocol data options
    instead of ``MethodSpec.data_defaults`` (``compare``: :func:`shared_data_defaults`); the job's own win."""
    run = copy.deepcopy(run)
    spec = method_of(run)
    run.model = run.model or spec.default_model
    run.method_args = fields_typed(spec.config_cls, run.method_args, "method", f"method '{run.method}'")
    spec.config_cls(**run.method_args)  # the method's own range checks
    run.train = fields_typed(TrainConfig, run.train, "train")
    run.robust = typed_robust(run.robust)  # before the aggregator sees it: it knows no "off"
    run.server_optimizer = written_server_optimizer(run.server_optimizer)
    check_server_optimizer(ServerOptConfig(**run.server_optimizer), run.method, spec.server_model,
                           run.secure_aggregation == "he")
    _check_privacy(run, spec)
    for site, overrides in run.site_train.items():
        if site not in run.site_names:
            raise ConfigError(f"site_train names '{site}', which is not one of {', '.join(run.site_names)}")
        run.site_train[site] = fields_typed(TrainConfig, overrides, f"site_train.{site}")
    run.task = _typed_task(run.task)
    run.data = fields_typed(_data_config_cls(), run.data, "data")
    run.data = _with_data_defaults(run, spec, spec.data_defaults if data_defaults is None else data_defaults)
    _resolve_paths(run, check_files)
    run.data_config()  # the partition scheme, noise rate, ... ranges
    _check_models(run, spec, check_files)
    if run.resume_from and check_files:  # a folder the simulator's server reads: checked with the plan
        run.resume_from = str(Path(run.resume_from).resolve())
    return run


def _check_privacy(run: RunConfig, spec: MethodSpec) -> None:
    """Encrypted aggregation, the dp result filter and DP-SGD against what the run and its method allow."""
    if run.secure_aggregation == "he":  # what the server can no longer do with encrypted updates
        from medflare.ops.he_aggregate import check_encrypted_run

        check_encrypted_run(spec, stream_aggregation=run.stream_aggregation, transfer_kind=run.transfer_kind,
                            transfer_dtype=run.transfer_dtype, download_dtype=run.download_dtype,
                            max_norm_ratio=run.robust.get("max_norm_ratio", 0.0), resume=bool(run.resume_from),
                            robust_rule=run.robust.get("rule", "mean"))
    if run.dp:
        if run.transfer_kind != "diff":
            raise ConfigError("dp filters act on weight differences: add --set transfer_kind=diff")
        check_dp_filter(run.dp)
    if not run.dp_sgd:
        return
    from medflare.dp_sgd import DPSGDConfig, check_method_supports_dp, dp_compatible_model

    # every setting written out (δ and the accountant included), so the job and its records say what ran
    run.dp_sgd = dataclasses.asdict(DPSGDConfig(**fields_typed(DPSGDConfig, run.dp_sgd, "dp_sgd")))
    check_method_supports_dp(run.method, spec.dp_sgd_blocker)
    if spec.server_model:  # sites of a method without a server model may train their own architectures
        channels, size = int(run.task.get("in_channels", 1)), int(run.task.get("image_size", 32))
        # built here once, at a small size, so a layer Opacus cannot train is refused before launch
        dp_compatible_model(spec.build_model(run.model, 2, channels, size, None, spec.config_cls(**run.method_args)))


def _resolve_paths(run: RunConfig, check_files: bool) -> None:
    """Make every path the job names absolute, against the folder medflare runs in: FLARE starts the simulator's
    (and a POC's) server and sites in workspace folders of their own, so a relative path would pass here and fail at
    every site. A hospital's own ``medflare_site.json`` paths are not in the job and stay as written.
    Raises DataError/ConfigError when ``check_files`` and a path names nothing here."""
    from medflare.data.public import absolute_public_source
    from medflare.data.sources import absolute_source

    if run.simulated:
        run.data["source"] = absolute_source(run.data["source"], "data.source", check_files)
    if run.data.get("public_source"):
        run.data["public_source"] = absolute_public_source(run.data["public_source"], check=check_files)
    if run.pretrained not in (None, IMAGENET):
        run.pretrained = os.path.abspath(os.path.expanduser(run.pretrained))


def _with_data_defaults(run: RunConfig, spec: MethodSpec, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The run's data options with a method's protocol options under them (simulated data only);
    ``eval_split=like_train`` follows single class ids, so a multi-label task keeps its slices pooled."""
    missing = {key: value for key, value in defaults.items() if key not in run.data}
    if not missing or not run.simulated:
        return run.data
    if missing.get("eval_split") == "like_train" and _multi_label_task(run, spec):
        missing.pop("eval_split")
    return {**run.data, **fields_typed(_data_config_cls(), missing, "data")}


def _multi_label_task(run: RunConfig, spec: MethodSpec) -> bool:
    """Whether the task is multi-label: as declared, else (a method that can train one) read off the data."""
    if set(TASK_SHAPE) <= set(run.task) or "multi_label" in run.task:
        return bool(run.task.get("multi_label", False))
    return spec.multi_label and _inferred_task(run).multi_label


def _check_models(run: RunConfig, spec: MethodSpec, check_files: bool) -> None:
    from medflare.models import get_model_info, list_models

    for site, model in {"": run.model, **run.site_model}.items():
        get_model_info(model)  # unknown, or an installed package's model that cannot load: refused before launch
        if site and site not in run.site_names:
            raise ConfigError(f"site_model names '{site}', which is not one of {', '.join(run.site_names)}")
    if spec.server_model and any(model != run.model for model in run.site_model.values()):
        raise ConfigError(
            f"'{run.method}' averages weights, so every site trains model '{run.model}'; per-site models "
            "(site_model) need a method that sends no weights"
        )
    if run.pretrained == IMAGENET and get_model_info(run.model).imagenet_weights is None:
        offline = [m for m in list_models() if get_model_info(m).imagenet_weights is not None]
        raise ConfigError(f"pretrained=imagenet: model '{run.model}' has no offline ImageNet weights "
                          f"(only {', '.join(offline)}); use --model {offline[0]} or a weights file")
    if check_files and run.pretrained not in (None, IMAGENET) and not Path(run.pretrained).is_file():
        raise ConfigError(f"--pretrained: weights file '{run.pretrained}' not found (relative paths are read "
                          "from the folder medflare runs in); give an existing file or 'imagenet'")


UNNAMED_SOURCES = ("synthetic", "medmnist")  # source kinds whose data never names its classes


def task_of(run: RunConfig) -> TaskSpec:
    """The declared task of a validated run; missing fields and the class names are read off the data
    (simulation) or must be given (site data: unnamed classes get the placeholder ``<class 1>``, ... that every
    site refuses until the lead sets ``task.class_names``). Raises ConfigError also when the method cannot train
    the task (multi-label needs ``MethodSpec.multi_label``)."""
    kind = str(run.data.get("source", "site")).partition(":")[0]
    site_data = kind == "site"
    # names from the data the lead points at, when it may name them (generated data and MedMNIST files never do)
    named_by_data = not site_data and kind not in UNNAMED_SOURCES and run.task.get("class_names") is None
    declared = set(TASK_SHAPE) <= set(run.task) and not named_by_data
    task = TaskSpec(**run.task) if declared else _inferred_task(run)
    if task.class_names is None and site_data:  # site data the lead named no classes of: the placeholder sites refuse
        from medflare.data.classes import placeholder_class_names

        task = dataclasses.replace(task, class_names=placeholder_class_names(task.num_classes))
    check_multi_label_support(method_of(run), task, multi_label_methods())  # before anything is exported or launched
    return task


def _data_config_cls() -> type:
    from medflare.data import DataConfig

    return DataConfig


def _typed_task(task: Mapping[str, Any]) -> dict[str, Any]:
    """The declared task fields, typed, with their ranges checked."""
    typed = fields_typed(TaskSpec, dict(task), "task")
    names = typed.get("class_names")
    if names is not None and "num_classes" in typed and len(names) != typed["num_classes"]:
        raise ConfigError(f"task.class_names lists {len(names)} names for task.num_classes={typed['num_classes']}; "
                          "give one name per class")
    from medflare.data.classes import class_names_refusal  # local: as _data_config_cls, no data at import

    refusal = class_names_refusal(names) if names is not None else ""
    if refusal:
        raise ConfigError(f"task.class_names: {refusal}")
    return typed


def _inferred_task(run: RunConfig) -> TaskSpec:
    """Class count, channels and image size of the (simulation) data source; declared fields must agree."""
    if run.data.get("source", "site") == "site":
        raise ConfigError(
            "with site-local data the job must declare task.num_classes, task.in_channels and task.image_size "
            "(e.g. --set task.num_classes=2 --set task.in_channels=1 --set task.image_size=28)"
        )
    from medflare.data import load_source
    from medflare.data.classes import class_names_refusal, same_form
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
    refusal = class_names_refusal(named) if named is not None else ""
    if refusal:
        raise ConfigError(f"the data '{run.data['source']}': {refusal}")
    declared_names = run.task.get("class_names")
    if declared_names is not None and named is not None and [same_form(n) for n in declared_names] != [
            same_form(n) for n in named]:
        raise ConfigError(f"task.class_names={list(declared_names)} but the data '{run.data['source']}' names its "
                          f"classes {named} (in label order); drop task.class_names or fix it")
    if declared_names is not None and len(declared_names) != inferred["num_classes"]:
        raise ConfigError(f"task.class_names lists {len(declared_names)} names but the data has "
                          f"{inferred['num_classes']} classes; give one name per class")
    return TaskSpec(**inferred, class_names=list(declared_names or splits.info["class_names"]))


def shared_data_defaults(methods: list[str], given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The protocol data options of methods compared on identical data: the union of their
    ``MethodSpec.data_defaults`` (FedAvg beside FCA is scored on FCA's like_train slices too), minus those the job
    ``given`` sets. Raises ConfigError when two methods want different values of an option the job leaves open."""
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


def find_preset(name: str, method: str, lead: str | None = None) -> tuple[str, Preset, bool]:
    """The preset ``name`` a run of ``method`` takes: its own, else (``compare``) ``lead``'s. Returns (its owner, the
    preset, whether ``method`` takes only its shared part); raises ConfigError naming the methods that have one."""
    for owner in (method, lead):
        if owner and name in get_method(owner).presets:
            return owner, get_method(owner).presets[name], owner != method
    having = [m for m in list_methods() if name in get_method(m).presets]
    known = sorted({p for m in list_methods() for p in get_method(m).presets})
    offer = f"methods with a '{name}' preset: {', '.join(having)}" if having else \
        f"known presets: {', '.join(known) or 'none'}"
    raise ConfigError(f"--preset {name}: method '{method}' has no preset '{name}'; {offer}")


def preset_layer(name: str | None, method: str, lead: str | None = None) -> dict[str, Any]:
    """The lowest run-config layer, of ``--preset name`` for ``method`` (empty without one). A method compared with
    ``lead`` that has no preset of its own takes ``lead``'s shared settings, not its hyperparameters."""
    if not name:
        return {}
    _, preset, shared_only = find_preset(name, method, lead)
    return copy.deepcopy(preset.shared() if shared_only else dict(preset.overrides))


def preset_lead(name: str | None, methods: list[str]) -> str | None:
    """``compare --preset``: the first compared method with that preset (the others share its settings)."""
    return next((m for m in methods if name and name in get_method(m).presets), None)


def build_global_model(method: str, model: str, num_classes: int, in_channels: int, image_size: int,
                       pretrained: str | None = None, method_args: Any = None, seed: int = 0,
                       plugins: list[str] | None = None, dp_sgd: bool = False) -> nn.Module:
    """The initial global network of ``method`` by name (``method_args``: its typed config, or options)."""
    spec = method_of(method, plugins)
    args = method_args if isinstance(method_args, spec.config_cls) else \
        from_dict(spec.config_cls, dict(method_args or {}), f"method '{method}'")
    return global_model(GlobalNetwork(spec, args, model, num_classes, in_channels, image_size, pretrained, seed,
                                      dp_sgd))


def checkpoint_method(facts: Mapping[str, Any]) -> tuple[MethodSpec, Any]:
    """The method a saved model's facts name and its typed configuration (``medflare predict``)."""
    spec = method_of(str(facts["method"]))
    return spec, from_dict(spec.config_cls, dict(facts.get("method_args") or {}), f"method '{spec.name}'")


def build_plan(run: RunConfig, task: TaskSpec, robust: Mapping[str, Any],
               plugins: list[str] | None = None, shot_groups: dict[str, list[int]] | None = None) -> RunPlan:
    """The plan of a validated ``run`` on ``task``: the one place the server rule and each site's training settings
    are built and checked. ``robust``: what the job carries; ``plugins``: the job's plugin modules when ``run``
    names no files. Raises ConfigError (one line) for stages that do not add up to the rounds, an out-of-range
    robust or wire option, a robust rule that cannot keep ``min_clients``, site settings that do not combine, or
    the method's own ``check_run``."""
    spec = get_method(run.method)
    method_cfg = spec.config_cls(**run.method_args)
    rule, stages, _ = server_rule(spec, method_cfg, run.rounds, robust, run.transfer_dtype,
                                  run.transfer_kind, run.download_dtype, task.multi_label)
    train = resolve_train_config(spec, run.train)
    sites = tuple(SitePlan(site, run.site_model.get(site, run.model),  # a site's own options make its own settings
                           resolve_train_config(spec, {**run.train, **run.site_train[site]})
                           if run.site_train.get(site) else train)
                  for site in run.site_names)
    _check_method_run(spec, method_cfg, sites, run)
    return RunPlan(
        job_name=run.job_name, method=run.method, method_args=dataclasses.asdict(method_cfg), model=run.model,
        pretrained=run.pretrained, seed=run.seed, task=task, data=run.site_data(),
        train=train, sites=sites, min_clients=run.required_clients,
        rounds=tuple(RoundPlan(ctx.round, ctx.stage, ctx.scored, tuple(rule.phases(ctx)))
                     for ctx in round_plan(stages, run.rounds)),
        evaluation=run.site_evaluation, patience=run.patience,
        straggler_seconds=run.straggler_seconds, task_timeout=run.task_timeout or DEFAULT_TASK_TIMEOUT,
        task_request_interval=run.task_request_interval, resume_from=run.resume_from, robust=dict(robust),
        transfer_dtype=run.transfer_dtype, download_dtype=run.download_dtype, transfer_kind=run.transfer_kind,
        stream_aggregation=run.stream_aggregation, dp=dict(run.dp), dp_sgd=dict(run.dp_sgd),
        secure_aggregation=run.secure_aggregation, audit=run.audit, tracking=run.tracking,
        plugins=tuple(run.plugin_modules() if plugins is None else plugins), shot_groups=shot_groups,
        server_optimizer=dict(run.server_optimizer), nvflare=installed_nvflare(),
    )


def resolve(run: RunConfig, mode: str | None = None, *, deployed: bool = False, check_files: bool = True,
            data_defaults: Mapping[str, Any] | None = None, task: TaskSpec | None = None) -> RunPlan:
    """The plan of the layered ``run`` (never changed) as a job written in ``mode`` carries it: the one entry every
    runner, export and recipe takes, and the only place a run is checked (:func:`validated`, with ``check_files``
    and ``data_defaults``). Robust settings: the run's own without a mode, else :func:`job_robust`'s (``deployed``:
    a POC or production job, whatever its data). ``task`` (:func:`task_of`) is read off the data when not given; so
    are the class counts of head/medium/tail groups when the run sets ``shot_thresholds``."""
    robust = typed_robust(run.robust) if mode is None else job_robust(run, mode, deployed)
    run = validated(dataclasses.replace(run, robust=robust), check_files, data_defaults)
    task = task or task_of(run)
    counts = site_facts(run.site_data(), run.site_names, task.num_classes)[1] if run.shot_thresholds else None
    return build_plan(run, task, run.robust, shot_groups=shot_groups_for(run, counts))


def job_robust(run: RunConfig, mode: str, deployed: bool = False) -> dict[str, float]:
    """The robust settings a job written in ``mode`` carries: the run's own in a BYOC job with simulated data (what
    FLARE's simulator runs) unless ``deployed``, else the deployment defaults under them (a POC run with simulated
    data is deployed)."""
    if not deployed and mode == "byoc" and run.data.get("source", "site") != "site":
        return typed_robust(run.robust)
    return deployment_robust(run.robust, run.secure_aggregation == "he")


def shot_groups_for(run: RunConfig, class_counts: list[int] | None) -> dict | None:
    """Head/medium/tail class ids from global training counts, when thresholds are configured."""
    if not run.shot_thresholds or class_counts is None:
        return None
    from medflare.metrics import shot_groups_from_counts

    head_min, tail_max = run.shot_thresholds
    return shot_groups_from_counts(class_counts, head_min=head_min, tail_max=tail_max)


def describe_sites(plan: RunPlan) -> tuple[dict[str, Any], list[int] | None]:
    """Per-site partition facts of the plan's simulated data (none for site data) and its global training class
    counts: what a run's outputs and ``medflare run`` show of each site."""
    return site_facts(plan.data, [site.name for site in plan.sites], plan.task.num_classes)


def site_facts(data: Mapping[str, Any], site_names: list[str],
               num_classes: int) -> tuple[dict[str, Any], list[int] | None]:
    """:func:`describe_sites` of the data the sites receive (``RunConfig.site_data``) split among ``site_names``."""
    if data.get("source", "site") == "site":
        return {}, None
    from medflare.data import describe_partition
    from medflare.site_config import typed_data_config

    facts = describe_partition(typed_data_config({**data, "num_classes": num_classes}))
    sites = {name: facts[i] for i, name in enumerate(site_names)}
    totals = [sum(int(f["class_counts"][k]) for f in facts) for k in range(len(facts[0]["class_counts"]))]
    return sites, totals


def _check_method_run(spec: MethodSpec, method_cfg: Any, sites: tuple[SitePlan, ...], run: RunConfig) -> None:
    """``MethodSpec.check_run`` on each site's settings and the simulated data (None for site data)."""
    if spec.check_run is None:
        return
    problems = spec.check_run(method_cfg, {site.name: site.train for site in sites},
                              run.data_config() if run.simulated else None)
    if problems:
        raise ConfigError(f"method '{run.method}': " + "; ".join(problems))


# ----- the plan in the job: app/config/medflare_plan.json ------------------------------------------------------
def plan_record(plan: RunPlan) -> dict[str, Any]:
    """``medflare_plan.json``: schema, fingerprint at writing (a later edit shows as a mismatch) and the plan."""
    return {"schema": PLAN_SCHEMA, "fingerprint": plan.digest(), "plan": plan.to_dict()}


def write_plan(plan: RunPlan, config_dir: Path) -> None:
    """``config_dir/medflare_plan.json``: the one file every medflare component of the job reads."""
    (config_dir / PLAN_FILE).write_text(json.dumps(plan_record(plan), indent=2) + "\n")


def read_plan(path: str | Path) -> tuple[RunPlan, str]:
    """The plan a ``medflare_plan.json`` holds, typed and range-checked again (it may have been edited), and the
    fingerprint it was written with; the job's plugins are imported first. Raises ConfigError (one line) for a
    missing or unreadable file, another schema, or a value that does not fit."""
    from medflare import readback  # local: the one reader of depth-limited JSON

    record = readback.load_json(Path(path), ConfigError)
    if not isinstance(record, dict) or record.get("schema") != PLAN_SCHEMA or not isinstance(record.get("plan"), dict):
        raise ConfigError(f"{path}: not a medflare plan of schema {PLAN_SCHEMA} (export the job again with this "
                          "medflare)")
    plugins = record["plan"].get("plugins") or []
    load_plugins([str(name) for name in plugins] if isinstance(plugins, list) else [])
    return RunPlan.from_dict(record["plan"], where=Path(path).name), str(record.get("fingerprint", ""))


def plan_from_job(job_dir: str | Path) -> RunPlan:
    """The plan a written job carries (``app/config/medflare_plan.json``): the job folder's one reader."""
    return read_plan(Path(job_dir) / APP_NAME / "config" / PLAN_FILE)[0]


def set_plan_resume(job_dir: str | Path, resume_from: str) -> None:
    """Rewrite a job's plan with ``resume_from`` (an earlier job id on the same server), as if exported so."""
    config_dir = Path(job_dir) / APP_NAME / "config"
    write_plan(dataclasses.replace(read_plan(config_dir / PLAN_FILE)[0], resume_from=resume_from), config_dir)
