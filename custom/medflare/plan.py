"""The run plan: what one job will do, resolved once from a validated :class:`RunConfig` and its task.

``RunConfig`` is layered user input; a :class:`RunPlan` is its resolution, typed and complete: the method's full
hyperparameters (defaults filled in), each site's model and training settings per stage, every round's stage and
phases, the robust, wire and privacy options the job carries, its timing and tracking. ``medflare config --plan``
prints it. The job folder is its serialisation: ``job_export.plan_from_job`` reads a job's configs back into the
plan, and a test checks, for every registered method, that it equals the plan the command line built. Nothing
here imports FLARE.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from medflare.methods.base import TrainConfig
from medflare.registry import get_method
from medflare.run_config import RunConfig
from medflare.server_setup import round_plan, server_rule
from medflare.site_runtime import TaskSpec, resolve_train_config

# Seconds a site may take for one task when the run sets no task_timeout. FLARE's own default (no limit) let
# one dead site keep a job RUNNING forever; with a limit the site counts as failed for that round.
DEFAULT_TASK_TIMEOUT = 3600


@dataclass(frozen=True)
class SitePlan:
    """One site: its architecture and its training settings in each stage (job's, the site's own override, the
    stage's on top)."""

    name: str
    model: str
    train: dict[str, TrainConfig]  # stage -> settings


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
    model: str
    pretrained: str | None
    seed: int
    task: TaskSpec
    data: dict[str, Any]  # what the sites receive ({"source": "site"}: each reads its own)
    sites: tuple[SitePlan, ...]
    min_clients: int  # valid updates a round needs
    rounds: tuple[RoundPlan, ...]
    evaluation: str
    patience: int
    straggler_seconds: int
    task_timeout: int  # effective: DEFAULT_TASK_TIMEOUT when the run sets none
    task_request_interval: float
    resume_from: str
    robust: dict[str, float]  # as the job carries it (deployment defaults under the run's own in a deployed job)
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

    def site(self, name: str) -> SitePlan:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(f"no site '{name}' in the plan; its sites: {', '.join(s.name for s in self.sites)}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (the TrainConfigs as dicts)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> RunPlan:
        """The plan :meth:`to_dict` wrote."""
        fields = dict(record)
        fields["task"] = TaskSpec(**fields["task"])
        fields["sites"] = tuple(SitePlan(s["name"], s["model"], {stage: TrainConfig(**train) for stage, train
                                                                 in s["train"].items()}) for s in fields["sites"])
        fields["rounds"] = tuple(RoundPlan(r["round"], r["stage"], r["scored"], tuple(r["phases"]))
                                 for r in fields["rounds"])
        fields["plugins"] = tuple(fields["plugins"])
        return cls(**fields)

    def describe(self) -> str:
        """The plan as indented JSON (``medflare config --plan``)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"


def build_plan(run: RunConfig, task: TaskSpec, robust: Mapping[str, float],
               plugins: list[str] | None = None) -> RunPlan:
    """The plan of a validated ``run`` on ``task``; ``robust`` is what the job carries (``job_export.job_robust``),
    ``plugins`` the job's plugin modules when ``run`` does not name their files.

    Raises:
        ConfigError: the method's stages do not add up to the rounds (as :meth:`RunConfig.validate` says).
    """
    spec = get_method(run.method)
    method_cfg = spec.config_cls(**run.method_args)
    rounds = round_steps(run.method, run.method_args, run.rounds, task.multi_label)
    stages = list(dict.fromkeys(r.stage for r in rounds))  # in the order they run
    sites = tuple(
        SitePlan(site, run.site_model.get(site, run.model),
                 {stage: resolve_train_config(spec, {**run.train, **run.site_train.get(site, {})}).for_stage(stage)
                  for stage in stages})
        for site in run.site_names
    )
    return RunPlan(
        job_name=run.job_name, method=run.method, method_args=dataclasses.asdict(method_cfg), model=run.model,
        pretrained=run.pretrained, seed=run.seed, task=task, data=run.site_data(), sites=sites,
        min_clients=run.required_clients, rounds=rounds, evaluation=run.site_evaluation, patience=run.patience,
        straggler_seconds=run.straggler_seconds, task_timeout=run.task_timeout or DEFAULT_TASK_TIMEOUT,
        task_request_interval=run.task_request_interval, resume_from=run.resume_from, robust=dict(robust),
        transfer_dtype=run.transfer_dtype, download_dtype=run.download_dtype, transfer_kind=run.transfer_kind,
        stream_aggregation=run.stream_aggregation, dp=dict(run.dp), dp_sgd=dict(run.dp_sgd),
        secure_aggregation=run.secure_aggregation, audit=run.audit, tracking=run.tracking,
        plugins=tuple(run.plugin_modules() if plugins is None else plugins),
    )


def round_steps(method: str, method_args: Mapping[str, Any], num_rounds: int,
                multi_label: bool) -> tuple[RoundPlan, ...]:
    """Every round's stage and phases, from the method's server rule (the stages must add up to the rounds)."""
    _, rule, stages, _ = server_rule(method, method_args, num_rounds, multi_label=multi_label)
    return tuple(RoundPlan(ctx.round, ctx.stage, ctx.scored, tuple(rule.phases(ctx)))
                 for ctx in round_plan(stages, num_rounds))
