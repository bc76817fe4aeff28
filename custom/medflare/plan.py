"""The run plan: what one job will do, resolved once from a validated :class:`RunConfig` and its task.

``RunConfig`` is layered user input; a :class:`RunPlan` is its resolution, typed and complete: the method's full
hyperparameters (defaults filled in), each site's model and training settings, every round's stage and phases,
the robust, wire and privacy options the job carries, its timing and tracking. ``medflare config --plan`` prints
it. A job carries it as ``app/config/medflare_plan.json`` (:func:`write_plan`), and every medflare component of the
job (persistor, aggregator, controller, executor, filters) takes that file and nothing else it could derive from
it: the server and each site load it with :func:`read_plan`; a site then localises it with its own
``medflare_site.json`` (:meth:`RunPlan.localise`). Nothing here imports FLARE's glue (``medflare.flare``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from medflare.config import from_dict
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, TrainConfig
from medflare.registry import get_method, load_plugins
from medflare.run_config import RunConfig
from medflare.server_setup import round_plan, server_rule
from medflare.site_config import (
    SiteFile,
    SiteSettings,
    TaskSpec,
    read_site_data_config,
    resolve_site_dp,
    resolve_site_model,
    resolve_train_config,
    site_index_from_name,
)

# Seconds a site may take for one task when the run sets no task_timeout. FLARE's own default (no limit) let
# one dead site keep a job RUNNING forever; with a limit the site counts as failed for that round.
DEFAULT_TASK_TIMEOUT = 3600
APP_NAME = "app"  # the one app of a job, deployed to every participant
ENCRYPTED_AGGREGATOR = "medflare.flare.he.EncryptedAggregator"  # the aggregator of secure_aggregation=he
PLAN_FILE = "medflare_plan.json"  # in the app's config folder: the job's plan, what every component reads
PLAN_SCHEMA = 1  # of PLAN_FILE; a plan of another schema is refused with the reason


@dataclass(frozen=True)
class SitePlan:
    """One site: its architecture and its training settings (the method's defaults, the job's options, the site's
    own override on top; ``train.for_stage(stage)`` in each stage)."""

    name: str
    model: str
    train: TrainConfig


@dataclass(frozen=True)
class RoundPlan:
    """One round: its stage, whether sites score it, and the phases (tasks) the server sends, in order."""

    round: int
    stage: str
    scored: bool
    phases: tuple[str, ...]


@dataclass(frozen=True)
class RunPlan:
    """Everything a job does, resolved (see the module's doc)."""

    job_name: str
    method: str
    method_args: dict[str, Any]  # every hyperparameter of the method, typed, defaults filled in
    model: str  # the server's (global) model; each site's is in ``sites``
    pretrained: str | None
    seed: int
    task: TaskSpec
    data: dict[str, Any]  # what the sites receive ({"source": "site"}: each reads its own)
    train: TrainConfig  # the method's defaults under the job's options: a site the plan does not name trains so
    sites: tuple[SitePlan, ...]  # the named sites, each with its own options over the job's
    min_clients: int  # valid updates a round needs
    rounds: tuple[RoundPlan, ...]
    evaluation: str
    patience: int
    straggler_seconds: int
    task_timeout: int  # effective: DEFAULT_TASK_TIMEOUT when the run sets none
    task_request_interval: float
    resume_from: str
    robust: dict[str, Any]  # as the job carries it (deployment defaults under the run's own in a deployed job)
    transfer_dtype: str
    download_dtype: str
    transfer_kind: str
    stream_aggregation: bool
    dp: dict[str, Any]
    dp_sgd: dict[str, Any]
    secure_aggregation: str
    audit: bool
    tracking: str
    plugins: tuple[str, ...]  # module names inside the job
    shot_groups: dict[str, list[int]] | None = None  # head/medium/tail class ids for long-tail metrics

    def __post_init__(self) -> None:
        if not self.sites:
            raise ConfigError("the plan names no site")
        if not 1 <= self.min_clients <= len(self.sites):
            raise ConfigError(f"min_clients must be between 1 and the plan's {len(self.sites)} sites, got "
                              f"{self.min_clients}")
        if not self.rounds or [r.round for r in self.rounds] != list(range(len(self.rounds))):
            raise ConfigError("the plan's rounds must be numbered 0, 1, ... in order")

    @property
    def spec(self) -> MethodSpec:
        """The registered method this plan runs."""
        return get_method(self.method)

    def site(self, name: str) -> SitePlan:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(f"no site '{name}' in the plan; its sites: {', '.join(s.name for s in self.sites)}")

    def site_settings(self, site: str, data: dict[str, Any], dp_sgd: dict[str, Any], model: str) -> SiteSettings:
        """What ``site`` runs of this plan, with what only the site decides: the data it reads, its DP-SGD and its
        architecture (``site_runtime``'s ``read_site_data_config``, ``resolve_site_dp``, ``resolve_site_model``)."""
        return SiteSettings(method=self.method, task=self.task, data=data, model=model,
                            method_args=self.method_args, train=dataclasses.asdict(self.site_train(site)),
                            seed=self.seed, evaluation=self.evaluation, dp_sgd=dp_sgd)

    def localise(self, site: str, site_file: SiteFile, simulated: bool) -> tuple[SiteSettings, int]:
        """What ``site`` runs of this plan with its own ``medflare_site.json`` (``site_file``: its data, DP-SGD and
        architecture), and the index of its partition of the job's simulated data (0 when it reads its own).
        ``simulated``: FLARE's simulator, whose sites have no file and take the job's data."""
        settings = self.site_settings(
            site,
            data=read_site_data_config(site_file, self.data, simulated),
            dp_sgd=resolve_site_dp(self.dp_sgd, site, site_file),
            model=resolve_site_model(self.method, self.model, self.site_models(), site, site_file),
        )
        index = 0 if settings.data.get("local") else site_index_from_name(site, [s.name for s in self.sites])
        return settings, index

    def site_train(self, site: str) -> TrainConfig:
        """The training settings of ``site``: its own in the plan, else the job's (a hospital's own name)."""
        return next((named.train for named in self.sites if named.name == site), self.train)

    def site_models(self) -> dict[str, str]:
        return {site.name: site.model for site in self.sites}

    def digest(self) -> str:
        """A short fingerprint of the whole plan: the server and every site log it, so one look shows they run
        the same job as the command line built (``medflare config --plan`` prints the plan it stands for)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (the TrainConfigs as dicts)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], where: str = PLAN_FILE) -> RunPlan:
        """The plan :meth:`to_dict` wrote, every value typed against its field (the method's arguments against
        the method's own config class, which fills in none: a plan lists them all).

        Raises:
            ConfigError: an unknown or ill-typed option, or a method that is not registered (one line).
        """
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in record
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{where}: the plan lacks {', '.join(missing)} (export the job again)")
        plan = from_dict(cls, dict(record), where)
        typed = dataclasses.asdict(from_dict(plan.spec.config_cls, plan.method_args, f"{where}: method '{plan.method}'"))
        return dataclasses.replace(plan, method_args=typed)

    def describe(self) -> str:
        """The plan as indented JSON (``medflare config --plan``)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"


def build_plan(run: RunConfig, task: TaskSpec, robust: Mapping[str, Any],
               plugins: list[str] | None = None, shot_groups: dict[str, list[int]] | None = None) -> RunPlan:
    """The plan of a validated ``run`` on ``task``: the one place the method's server rule and each site's training
    settings are built and checked; ``robust`` is what the job carries (``job_export.job_robust``), ``plugins`` the
    job's plugin modules when ``run`` does not name their files, ``shot_groups`` the classes of the long-tail
    metrics (``launch.shot_groups_for``).

    Raises:
        ConfigError: the method's stages do not add up to the rounds, a robust or wire option is out of range or
            a robust rule cannot keep ``min_clients`` sites, a site's training settings do not combine, or the
            method's own pre-launch check (``MethodSpec.check_run``) refuses the run (one line naming the option).
    """
    spec, rule, stages, defences = server_rule(run.method, run.method_args, run.rounds, robust, run.transfer_dtype,
                                               run.transfer_kind, run.download_dtype, task.multi_label)
    defences.check_quorum(run.required_clients, run.clients)
    method_cfg = spec.config_cls(**run.method_args)
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
    )


def _check_method_run(spec: MethodSpec, method_cfg: Any, sites: tuple[SitePlan, ...], run: RunConfig) -> None:
    """The method's own pre-launch checks (``MethodSpec.check_run``) of each site's settings and, in a simulation,
    the job's data (None when each site reads its own), so a job never fails at its first task over options
    known here."""
    if spec.check_run is None:
        return
    problems = spec.check_run(method_cfg, {site.name: site.train for site in sites},
                              run.data_config() if run.simulated else None)
    if problems:
        raise ConfigError(f"method '{run.method}': " + "; ".join(problems))


# ----- the plan in the job: app/config/medflare_plan.json ------------------------------------------------------
def plan_record(plan: RunPlan) -> dict[str, Any]:
    """What ``medflare_plan.json`` holds: the schema it is written in, the plan's fingerprint when it was written
    (an edit since shows as a different fingerprint at the server and every site) and the plan."""
    return {"schema": PLAN_SCHEMA, "fingerprint": plan.digest(), "plan": plan.to_dict()}


def write_plan(plan: RunPlan, config_dir: Path) -> None:
    """``config_dir/medflare_plan.json``: the one file every medflare component of the job reads."""
    (config_dir / PLAN_FILE).write_text(json.dumps(plan_record(plan), indent=2) + "\n")


def read_plan(path: str | Path) -> tuple[RunPlan, str]:
    """The plan a ``medflare_plan.json`` holds, every value typed and range-checked again (the file may have been
    edited), and the fingerprint it was written with. The job's plugins are imported first: their methods are
    looked up here.

    Raises:
        ConfigError: a missing or unreadable file, another schema, or a value that does not fit (one line naming
            the file and the option).
    """
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
