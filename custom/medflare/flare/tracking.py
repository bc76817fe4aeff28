"""Experiment tracking through FLARE's analytics events: sites fire them per local epoch and task
(:class:`SiteMetricsToServer` forwards them), the controller per round; FLARE's TensorBoard and MLflow receivers record
them (:class:`MissingTrackerReceiver` without their package). These events travel beside the task results, past a
method's Payload and the site's privacy filters, so what a site may stream is declared once
(:data:`SITE_STREAMED_TAGS`): only values its result carries anyway, or the job's own lr schedule."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import shutil
from pathlib import Path
from typing import Any, Mapping

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, LogWriterName, TrackConst
from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import EventScope, FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
from nvflare.app_common.widgets.streaming import AnalyticsReceiver

from medflare import contracts
from medflare.metrics.classification import compute_metrics, stats_from_dict
from medflare.run_config import RECEIVERS, TRACKERS

TB_FOLDER = "tb_events"  # in the server's job folder (FLARE's default), one sub-folder per sender
MLFLOW_DB = "mlflow.db"  # FLARE's MLflow receiver writes this SQLite store into the server's job result folder
EPOCH_LOSS = "train/epoch_loss"  # step: the job-wide local epoch
ROUND_LOSS = "train/loss"  # step: the round, from 1 (as the server's train_loss/<site>); the result's train_loss
ROUND_SECONDS = "train/seconds"  # the result's train_seconds
LEARNING_RATE = "train/lr"  # the learning rate the round's last step used (the job's schedule)
DP_EPSILON = "privacy/epsilon"  # DP-SGD: the result's dp_epsilon, ε the site has spent so far at the job's δ
# The scalar metrics of compute_metrics a site streams as val/<name>, step: the received model's version
SITE_VAL_METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "macro_precision", "macro_recall", "auc_macro_ovr",
                    "bauc", "loss")
# Everything a site streams to the server, beside its task results (see the module docstring).
SITE_STREAMED_TAGS = frozenset({EPOCH_LOSS, ROUND_LOSS, ROUND_SECONDS, LEARNING_RATE, DP_EPSILON,
                                *(f"val/{name}" for name in SITE_VAL_METRICS)})
INSTALL_HINT = "pip install 'medflare[tracking]'"
DEFAULT_EXPERIMENT = "medflare"  # the MLflow experiment of every job unless MLFLOW_EXPERIMENT_NAME names another
MAX_PARAM_CHARS = 500  # MLflow params are short strings (older MLflow servers refuse longer ones)
SIMULATOR_JOB_ID = "simulate_job"  # every job FLARE's simulator runs has this id


def missing_notice(tracking: str) -> str | None:
    """One line saying which trackers record nothing here because their package is missing, or None."""
    missing = [package for package, _ in (RECEIVERS[name] for name in TRACKERS[tracking])
               if importlib.util.find_spec(package) is None]
    return (f"{' and '.join(missing)} not installed here, so this run records no {' or '.join(missing)} metrics "
            f"(the run itself is unaffected); {INSTALL_HINT} to record them") if missing else None


def server_components(tracking: str, mlflow_args: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The receivers a job's server config lists for a :data:`TRACKERS` choice (``mlflow_args``: the MLflow
    receiver's, :func:`mlflow_receiver_args`)."""
    args = {"mlflow": dict(mlflow_args or {})}
    return [{"id": f"{name}_receiver", "path": RECEIVERS[name][1], "args": args.get(name, {})}
            for name in TRACKERS[tracking]]


def mlflow_receiver_args(params: Mapping[str, Any], run_name: str, tags: Mapping[str, str], deployed_env: str,
                         experiment: str = "") -> dict[str, Any]:
    """The MLflow receiver's arguments: FLARE's ``kw_args`` (``experiment``, ``run_name``, to which the receiver
    appends the short job id, and the run ``tags`` known when the job is written), the job's settings ``params``
    (:func:`flat_params`) and the ``env`` tag outside FLARE's simulator (``deployed_env``: poc or prod)."""
    return {"kw_args": {TrackConst.EXPERIMENT_NAME: experiment or DEFAULT_EXPERIMENT, TrackConst.RUN_NAME: run_name,
                        TrackConst.EXPERIMENT_TAGS: {}, TrackConst.RUN_TAGS: dict(tags)},
            "params": flat_params(params), "deployed_env": deployed_env}


def flat_params(settings: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Settings as MLflow params: a nested mapping's entries under dotted keys (``train.stages.finetune.lr``), not
    JSON: FLARE's job configurator reads a text in braces as a variable reference (``"{}"`` would load as None)."""
    params: dict[str, str] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            params.update(flat_params(value, f"{prefix}{key}."))
        else:
            params[f"{prefix}{key}"] = param_text(value)
    return params


def param_text(value: Any) -> str:
    """An MLflow param value: numbers and names as they are, lists as JSON; cut to MAX_PARAM_CHARS."""
    text = json.dumps(list(value), default=str) if isinstance(value, (list, tuple)) else str(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 1] + "…"


def client_components(tracking: str) -> list[dict[str, Any]]:
    """The site-side converter that forwards the declared metrics to the server (none when tracking is off)."""
    forward = {"id": "metrics_to_server", "path": "medflare.flare.tracking.SiteMetricsToServer", "args": {}}
    return [forward] if TRACKERS[tracking] else []


# ----- sending ------------------------------------------------------------------------------------------
def send_scalars(component: FLComponent, fl_ctx: FLContext, scalars: Mapping[str, float], step: int) -> None:
    """Fire one FLARE analytics event per scalar (TensorBoard syntax; MLflow's receiver converts it), each in a
    fresh context from the engine, so the caller's (a task's, the controller's) is never touched."""
    engine = fl_ctx.get_engine()
    for tag, value in scalars.items():
        dxo = create_analytic_dxo(tag=tag, value=float(value), data_type=AnalyticsDataType.SCALAR,
                                  writer=LogWriterName.TORCH_TB, global_step=int(step))
        with engine.new_context() as event_ctx:
            send_analytic_dxo(component, dxo=dxo, fl_ctx=event_ctx, event_type=ANALYTIC_EVENT_TYPE)


def round_scalars(evaluation: Mapping[str, Any]) -> dict[str, float]:
    """The scalar metrics of one model version as TensorBoard tags: ``val/`` and ``test/<metric>`` pooled over
    sites, ``site_mean/<metric>`` the unweighted mean of the sites' test metrics, ``<site>/test/<metric>`` each
    site's own (named as the site's own ``<site>/val/<metric>`` series), and ``<name>/...`` of each method-declared evaluation."""
    scalars = {tag: value for split in ("val", "test", "site_mean")
               for tag, value in _prefixed(f"{split}/", evaluation.get(split, {})).items()}
    for site, metrics in evaluation.get("by_site", {}).items():
        scalars.update(_prefixed(f"{site}/test/", metrics))
    for name, block in evaluation.get("extra", {}).items():
        scalars.update({f"{name}/{tag}": value for tag, value in round_scalars(block).items()})
    return scalars


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A finished round's own facts: its wall time, and each site's share and mean training loss."""
    scalars = {"round/wall_seconds": record["wall_seconds"]} if _is_number(record.get("wall_seconds")) else {}
    scalars.update(_prefixed("share/", record.get("share", {})))
    for site, facts in record.get("sites", {}).items():
        if _is_number(facts.get("train_loss")):
            scalars[f"train_loss/{site}"] = float(facts["train_loss"])
    return scalars


def site_validation_scalars(meta: Mapping[str, Any], num_classes: int, multi_label: bool = False) -> dict[str, float]:
    """A site's ``val/<metric>`` of the model it received, from the ``eval_val`` counts its result carries (none:
    ``site_evaluation=off``, every task but the final validation with ``final``, an unscored stage)."""
    if contracts.EVAL_VAL not in meta:
        return {}
    metrics = compute_metrics(stats_from_dict(meta[contracts.EVAL_VAL], num_classes, multi_label))
    return _prefixed("val/", {name: metrics.get(name) for name in SITE_VAL_METRICS})


def site_training_scalars(meta: Mapping[str, Any], learning_rate: float | None) -> dict[str, float]:
    """A site's facts of one round of local training: mean loss, seconds, ε spent with DP-SGD (from its result's
    meta) and lr."""
    facts = {ROUND_LOSS: meta.get(contracts.TRAIN_LOSS), ROUND_SECONDS: meta.get(contracts.TRAIN_SECONDS),
             DP_EPSILON: meta.get(contracts.DP_EPSILON), LEARNING_RATE: learning_rate}
    return {tag: float(value) for tag, value in facts.items() if _is_number(value)}


def _prefixed(prefix: str, metrics: Mapping[str, Any]) -> dict[str, float]:
    return {prefix + name: float(value) for name, value in metrics.items() if _is_number(value)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ----- the site's side ------------------------------------------------------------------------------------
class SiteMetricsToServer(ConvertToFedEvent):
    """FLARE's ``ConvertToFedEvent`` (same arguments) forwarding only the metrics a site declares it streams: an
    analytics event whose tag is not in :data:`SITE_STREAMED_TAGS`, or whose value is not a finite number, stays
    at the site (and is logged as refused)."""

    def __init__(self, events_to_convert: list[str] | None = None, fed_event_prefix: str = "fed.") -> None:
        super().__init__(events_to_convert or [ANALYTIC_EVENT_TYPE], fed_event_prefix)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        federated = fl_ctx.get_prop(FLContextKey.EVENT_SCOPE, EventScope.LOCAL) == EventScope.FEDERATION
        if event_type in self.events_to_convert and not federated:
            refusal = undeclared_stream(fl_ctx.get_prop(FLContextKey.EVENT_DATA, None))
            if refusal:
                self.log_warning(fl_ctx, f"not streamed to the server: {refusal}", fire_event=False)
                return
        super().handle_event(event_type, fl_ctx)


def undeclared_stream(data: Any) -> str | None:
    """Why an analytics event may not leave the site, or None when it is a declared scalar."""
    if not isinstance(data, Shareable):
        return "the event carries no analytics record"
    try:
        record = from_shareable(data).data or {}
    except Exception:  # noqa: BLE001 - anything unreadable is refused the same way
        return "the event carries no analytics record"
    tag, value = record.get(TrackConst.TRACK_KEY), record.get(TrackConst.TRACK_VALUE)
    if tag not in SITE_STREAMED_TAGS:
        return f"'{tag}' is not among the declared site metrics {sorted(SITE_STREAMED_TAGS)}"
    if not _is_number(value):
        return f"'{tag}' must be a finite number"
    return None


# ----- the server's side ----------------------------------------------------------------------------------
class MissingTrackerReceiver(AnalyticsReceiver):
    """Stands in for a receiver whose package the server lacks: one log line, then nothing is recorded. It takes
    the real receiver's arguments, so the job config reads the same either way."""

    package = ""

    def __init__(self, **options: Any) -> None:
        super().__init__(events=options.pop("events", None))
        self.options = options

    def initialize(self, fl_ctx: FLContext) -> None:
        self.log_warning(fl_ctx, f"{self.package} is not installed on the server: no {self.package} records for "
                                 f"this job ({INSTALL_HINT}); the job runs on", fire_event=False)

    def save(self, fl_ctx: FLContext, shareable: Shareable, record_origin: str) -> None:
        """Nothing to record without the package."""

    def finalize(self, fl_ctx: FLContext) -> None:
        """Nothing to close."""


def receiver_base(module: str, name: str, package: str) -> type:
    """FLARE's receiver class ``module.name``, or, on a server without ``package``, a stand-in that logs one line
    (the medflare receivers subclass what this returns, so a job naming them loads either way)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:  # tensorboard and mlflow are optional extras (medflare[tracking])
        return type(f"Missing{name}", (MissingTrackerReceiver,), {"package": package, "__module__": __name__})


def keep_server_records(run_dir: Path, out: Path) -> list[Path]:
    """Copy the job's tracking records (TensorBoard folders, MLflow store) from the server's job folder ``run_dir``
    (a simulator's ``server/simulate_job``, a downloaded ``workspace``) into ``out``; the copies' paths."""
    found = [path for name in (TB_FOLDER, MLFLOW_DB) for path in sorted(run_dir.glob(f"**/{name}"))[:1]]
    for path in found:
        if path.is_dir():
            shutil.copytree(path, out / path.name, dirs_exist_ok=True)
        else:
            shutil.copy(path, out / path.name)
    return [out / path.name for path in found]
