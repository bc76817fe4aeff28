"""The run plan: what one job will do, resolved once from a validated :class:`RunConfig` and its task.

``RunConfig`` is layered user input; a :class:`RunPlan` is its resolution, typed and complete: the method's full
hyperparameters (defaults filled in), each site's model and training settings per stage, every round's stage and
phases, the robust, wire and privacy options the job carries, its timing and tracking. ``medflare config --plan``
prints it. The job folder is its serialisation: :func:`plan_from_job` reads a job's configs back into the plan,
and :func:`plan_from_app` is how the server and every site rebuild it from the app FLARE deployed to them; a test
checks, for every registered method, that each equals the plan the command line built. Nothing here imports
FLARE's glue (``medflare.flare``).
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
from medflare.methods.base import TrainConfig
from medflare.registry import get_method, load_plugins
from medflare.run_config import RECEIVERS, TRACKERS, RunConfig
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
    method_options: dict[str, Any]  # the ones the run set: what the job's configs and its model's facts carry
    model: str
    pretrained: str | None
    seed: int
    task: TaskSpec
    data: dict[str, Any]  # what the sites receive ({"source": "site"}: each reads its own)
    train: dict[str, Any]  # the job's own training options (typed), under which each site's and stage's merge
    train_resolved: TrainConfig  # the job's options over the method's defaults (what summaries record)
    site_train: dict[str, dict[str, Any]]  # a site's own options over the job's
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

    def site_settings(self, site: str, data: dict[str, Any], dp_sgd: dict[str, Any], model: str) -> SiteSettings:
        """What ``site`` runs of this plan, with what only the site decides: the data it reads, its DP-SGD and its
        architecture (``site_runtime``'s ``read_site_data_config``, ``resolve_site_dp``, ``resolve_site_model``)."""
        return SiteSettings(method=self.method, task=self.task, data=data, model=model,
                            method_args=self.method_args, train={**self.train, **self.site_train.get(site, {})},
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
    def from_dict(cls, record: Mapping[str, Any]) -> RunPlan:
        """The plan :meth:`to_dict` wrote."""
        fields = dict(record)
        fields["task"] = TaskSpec(**fields["task"])
        fields["train_resolved"] = TrainConfig(**fields["train_resolved"])
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
        job_name=run.job_name, method=run.method, method_args=dataclasses.asdict(method_cfg),
        method_options=dict(run.method_args), model=run.model,
        pretrained=run.pretrained, seed=run.seed, task=task, data=run.site_data(), train=dict(run.train),
        train_resolved=resolve_train_config(spec, run.train),
        site_train={site: dict(options) for site, options in run.site_train.items()}, sites=sites,
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


# ----- the job read back: the plan it carries ----------------------------------------------------------------
def plan_from_job(job_dir: str | Path) -> RunPlan:
    """The plan a written job carries, read back from its ``meta.json`` and the app's server and site configs (what
    the server and every site read: one app deployed to all)."""
    job = Path(job_dir)
    return plan_from_app(job / APP_NAME / "config", job / "meta.json")


def plan_from_app(config_dir: str | Path, meta_path: str | Path | None = None) -> RunPlan:
    """The plan of a deployed app: its ``config_fed_server.json`` and ``config_fed_client.json`` in ``config_dir``
    and the job's meta (FLARE writes it beside every participant's app; absent: the job's name stays unknown).
    The server and each site rebuild their job's plan with this, as :func:`plan_from_job` does from a job folder.

    Raises:
        ConfigError: a config that is missing, not JSON or not a medflare job, or server and site configs that
            disagree about what the sites build (:func:`run_from_job`).
    """
    return job_from_app(config_dir, meta_path)[1]


def job_from_app(config_dir: str | Path, meta_path: str | Path | None = None) -> tuple[RunConfig, RunPlan]:
    """The run a deployed app records (:func:`run_from_job`) and the plan it resolves to (:func:`plan_from_app`):
    a report describes the first as the run's configuration and checks the second against the server's."""
    meta, server, client = app_configs(Path(config_dir), meta_path)
    try:
        plugins = _executor(client)["args"].get("plugins", [])
        robust = next(c for c in server["components"] if c["id"] == "aggregator")["args"].get("robust", {})
    except (KeyError, TypeError, IndexError, StopIteration) as exc:
        raise ConfigError(f"the job config lacks {exc or 'its aggregator'}: not a medflare job") from exc
    load_plugins(plugins)  # the job's own methods, before they are looked up
    run = run_from_job(meta, server, client)
    return run, build_plan(run, TaskSpec(**run.task), robust, plugins=plugins)


def read_app_config(config_dir: Path, side: str) -> dict[str, Any]:
    """``config_fed_<side>.json`` in an app's ``config_dir`` (exported jobs), or ``.conf`` (jobs made from
    ``job_templates/``, HOCON).

    Raises:
        ConfigError: neither is there, or the one there does not parse (one line naming it).
    """
    for suffix in (".json", ".conf"):
        path = config_dir / f"config_fed_{side}{suffix}"
        if path.is_file():
            try:
                if suffix == ".json":
                    return json.loads(path.read_text())
                from pyhocon import ConfigFactory  # FLARE's own reader of HOCON configs

                return json.loads(json.dumps(ConfigFactory.parse_file(str(path)).as_plain_ordered_dict()))
            except Exception as exc:  # noqa: BLE001 - any parse failure means the same to the user
                raise ConfigError(f"cannot read the job config {path}: {' '.join(str(exc).split())}") from exc
    raise ConfigError(f"no config_fed_{side}.json (or .conf) in {config_dir}: not a job's app")


def app_configs(config_dir: Path, meta_path: str | Path | None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The job's meta (``{}`` where there is none), server and site configs of an app's ``config_dir``."""
    from medflare import readback  # local: the one reader of depth-limited JSON

    meta = readback.load_json(Path(meta_path), ConfigError) if meta_path and Path(meta_path).is_file() else {}
    server, client = (read_app_config(config_dir, side) for side in ("server", "client"))
    return (meta if isinstance(meta, dict) else {}), server, client


def run_from_job(meta: Mapping[str, Any], server: Mapping[str, Any], client: Mapping[str, Any]) -> RunConfig:
    """The RunConfig a job's configs record (its task declared), from the parsed ``meta.json`` (``{}`` where there
    is none, e.g. beside a server's results) and the app's configs. Options a job made from a template may leave
    out take their defaults. ``robust`` stays the run's own: the job carries the deployment's defences under it
    (:func:`job_robust`), which cannot be told apart from settings the run made.

    Raises:
        ConfigError: a component or argument medflare writes is missing: not a medflare job.
    """
    try:
        components = {c["id"]: c for c in server["components"]}
        persistor, aggregator = components["persistor"]["args"], components["aggregator"]
        model, controller = persistor["model"]["args"], server["workflows"][0]["args"]
        executor = _executor(client)["args"]
        class_names = (persistor.get("facts") or {}).get("task", {}).get("class_names")
        result_filters = [f for chain in client.get("task_result_filters", []) for f in chain["filters"]]
        wire = aggregator["args"]
        shape = ("num_classes", "in_channels", "image_size")
        _agree(executor, {**model, "task": {k: model[k] for k in shape}}, ("method", "model", "seed", "method_args"))
        _agree(executor, {**wire, "task": {k: wire[k] for k in shape[:1]}}, ("method", "method_args"))
        fields = {
            "method": executor["method"], "model": executor["model"], "pretrained": model.get("pretrained"),
            "seed": executor["seed"], "method_args": executor["method_args"], "rounds": controller["num_rounds"],
            "min_clients": controller["min_clients"], "clients": len(executor["sites"]),
            "task": vars(TaskSpec(**{**executor["task"], **({"class_names": class_names} if class_names else {})})),
            # the seed the sites get: left out where it is the run's own (RunConfig.site_data adds that one back)
            # simulated data: without what RunConfig.site_data adds back (the sites' count, the run's own seed)
            "data": {k: v for k, v in executor["data"].items() if executor["data"].get("source", "site") == "site"
                     or (k != "num_sites" and not (k == "seed" and v == model["seed"]))},
            "train": executor["train"], "site_train": executor.get("site_train", {}),
            "site_model": executor.get("site_model") or {}, "site_evaluation": executor.get("evaluation", "every_round"),
            "dp_sgd": executor.get("dp_sgd") or {},
            "straggler_seconds": controller.get("wait_time_after_min_received", 600),
            "task_timeout": controller.get("train_timeout", 0), "patience": controller.get("patience", 0),
            "resume_from": controller.get("resume_from", ""),
            "task_request_interval": server.get("server", {}).get("task_request_interval", 0.1),
            "name": meta.get("name", ""),
            "transfer_dtype": wire.get("transfer_dtype", "float32"), "download_dtype": wire.get("download_dtype", "float32"),
            "transfer_kind": wire.get("transfer_kind", "weights"),
            "stream_aggregation": wire.get("stream_aggregation", False),
            "secure_aggregation": "he" if aggregator["path"] == ENCRYPTED_AGGREGATOR else "off",
            "dp": next((f["args"] for f in result_filters if f["path"].endswith(".UpdatePrivacy")), {}),
            "audit": any(f["path"].endswith(".PayloadRecorder") for f in result_filters),
            "tracking": tracking_of(server["components"]),
        }
    except (KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"the job config lacks {exc}: not a medflare job") from exc
    return from_dict(RunConfig, fields, "job config")


def _agree(site: Mapping[str, Any], server: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """The sites' executor and a server component say the same of what both build (the task's shape included).

    Raises:
        ConfigError: naming the first option they disagree on (a job edited on one side only).
    """
    for key in (*keys, "task"):
        theirs = {k: site[key][k] for k in server[key]} if key == "task" else site.get(key)
        if theirs != server.get(key):
            raise ConfigError(f"the job's site and server configs disagree on {key}: {theirs!r} at the sites, "
                              f"{server.get(key)!r} at the server; edit both (or export the job again)")


def _executor(client: Mapping[str, Any]) -> Mapping[str, Any]:
    return client["executors"][0]["executor"]


def tracking_of(components: list[Mapping[str, Any]]) -> str:
    """The ``tracking`` choice whose receivers a server config lists."""
    listed = tuple(name for name, (_, path) in RECEIVERS.items() if any(c["path"] == path for c in components))
    return next(choice for choice, receivers in TRACKERS.items() if set(receivers) == set(listed))
