"""Write a FLARE job folder for any registered method: one builder for every method and every environment.

Modes: ``byoc`` carries the medflare package in ``app/custom/``; ``preinstalled`` carries configs only, for sites
that allow-list exactly these ``medflare.flare.`` components (:mod:`medflare.console.deploy.policies`). Every job but a
BYOC one with simulated data (what the simulator runs) gets the server's robust defences
(``server_setup.DEPLOY_ROBUST``). Outside ``medflare.flare``: nothing a job can name may write files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from medflare.console.files import write_recorded
from medflare.contracts import TRAIN_PHASE as TASK_TRAIN, privacy_scope
from medflare.errors import ConfigError
from medflare.flare import tracking
from medflare.job_code import META_KEY, code_digest
from medflare.plan import APP_NAME, ENCRYPTED_AGGREGATOR, PLAN_FILE, RunPlan, set_plan_resume, write_plan

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../custom/medflare
CONSOLE_DIR = Path(__file__).resolve().parent  # what a job never imports (tests/test_layering.py), so never ships
MODES = ("byoc", "preinstalled")
PLAIN_AGGREGATOR = "medflare.flare.aggregator.MedflareAggregator"
# FLARE's receiver pulls a model's arrays in chunks, one request each (2 MiB by default). Over a 100 Mbit/s link,
# 16 MiB chunks brought a ResNet-18 round from 1.160x to 1.128x its floor (3 runs each, benchmarks/link_speed.py;
# docs/benchmarks.md); 64 MiB did not help. The sender's job config decides: both sides write it.
DOWNLOAD_CHUNK = {"np_download_chunk_size": 16 * 1024 * 1024}


def plan_args() -> dict[str, Any]:
    """What every medflare component of a job takes: the job's plan file, and nothing it could derive from it."""
    return {"plan_file": PLAN_FILE}


def server_config(plan: RunPlan) -> dict[str, Any]:
    """config_fed_server.json: medflare's persistor, aggregator and controller, and the tracking receivers."""
    return {
        "format_version": 2,
        # FLARE's default 2 s polling interval dominates short rounds; 0.1 s is safe on loopback and LAN.
        "server": {"heart_beat_timeout": 600, "task_request_interval": plan.task_request_interval},
        **DOWNLOAD_CHUNK,
        "task_data_filters": [],
        "task_result_filters": [],
        "components": [
            {"id": "persistor", "path": "medflare.flare.persistor.MedflareModelPersistor", "args": plan_args()},
            {"id": "aggregator",
             "path": ENCRYPTED_AGGREGATOR if plan.secure_aggregation == "he" else PLAIN_AGGREGATOR, "args": plan_args()},
            *tracking.server_components(plan.tracking, mlflow_args(plan)),
        ],
        "workflows": [{"id": "controller", "path": "medflare.flare.controller.MedflareController",
                       "args": {**plan_args(), "persistor_id": "persistor", "aggregator_id": "aggregator"}}],
    }


def mlflow_args(plan: RunPlan) -> dict[str, Any] | None:
    """The MLflow receiver's arguments (None without it): the experiment (``$MLFLOW_EXPERIMENT_NAME`` where the job
    is written), the run's name ``<method>-<model>-s<seed>`` and the settings as params named as ``--set`` keys, the
    task's facts (``task.num_classes``, ...) beside them."""
    if "mlflow" not in tracking.TRACKERS[plan.tracking]:
        return None
    train = plan.train  # a site's own options (site_train) are in the plan, not in these params
    params = {
        **{key: getattr(plan, key) for key in ("method", "model", "pretrained", "seed")},
        "rounds": len(plan.rounds), "clients": len(plan.sites), "min_clients": plan.min_clients,
        **{f"task.{key}": value for key, value in dataclasses.asdict(plan.task).items()},
        **{f"data.{key}": value for key, value in plan.data.items()},
        # named even when unset, so that a search on it finds the runs without a window too
        "data.window": plan.data.get("window") or "none",
        **{f"train.{key}": value for key, value in dataclasses.asdict(train).items()},
        **{f"method.{key}": value for key, value in plan.method_args.items()},
    }
    # a deployed job that brings its own (simulated) data runs only at sites that opted in to such data: a POC's
    deployed_env = "prod" if plan.data.get("source", "site") == "site" else "poc"
    return tracking.mlflow_receiver_args(
        params, run_name=f"{plan.method}-{plan.model}-s{plan.seed}", tags={"method": plan.method, "model": plan.model},
        deployed_env=deployed_env, experiment=os.environ.get("MLFLOW_EXPERIMENT_NAME", ""),
    )


def client_config(plan: RunPlan) -> dict[str, Any]:
    """config_fed_client.json: the medflare executor for every task (it reads the plan file)."""
    return {
        "format_version": 2,
        **DOWNLOAD_CHUNK,
        "executors": [{"tasks": ["*"],  # train, validate, submit_model and any method-specific phase
                       "executor": {"id": "executor", "path": "medflare.flare.executor.MedflareExecutor",
                                    "args": plan_args()}}],
        "task_result_filters": _result_filters(plan),
        "task_data_filters": _data_filters(plan),
        "components": tracking.client_components(plan.tracking),
    }


def task_names(plan: RunPlan) -> list[str]:
    """Every task name the job's server sends: the rule's phases over all rounds, validate and submit_model."""
    from medflare.flare.tasks import TASK_SUBMIT_MODEL, TASK_VALIDATE

    return sorted({phase for step in plan.rounds for phase in step.phases} | {TASK_VALIDATE, TASK_SUBMIT_MODEL})


def _result_filters(plan: RunPlan) -> list[dict[str, Any]]:
    """Per task one chain (FLARE allows one): the DP filter on train results, the encryption of the model-carrying
    results (HE), then the audit recorder, so it records what really leaves (a site's privacy filters run first)."""
    from medflare.flare.tasks import TASK_SUBMIT_MODEL

    dp = {"path": "medflare.flare.privacy.UpdatePrivacy", "args": plan_args()} if plan.dp else None
    seal = {"path": "medflare.flare.he.EncryptResult", "args": plan_args()} if plan.secure_aggregation == "he" else None
    chains = []
    for name in task_names(plan):
        filters = ([dp] if dp and name == TASK_TRAIN else []) + \
            ([seal] if seal and name in (TASK_TRAIN, TASK_SUBMIT_MODEL) else []) + \
            ([_recorder("result")] if plan.audit else [])
        if filters:
            chains.append({"tasks": [name], "filters": filters})
    return chains


def _data_filters(plan: RunPlan) -> list[dict[str, Any]]:
    """On every task: the audit recorder (what arrives, ciphertexts as they are), then the decryption of the
    global model (secure_aggregation=he)."""
    filters = ([_recorder("task")] if plan.audit else []) + \
        ([{"path": "medflare.flare.he.DecryptTask", "args": {}}] if plan.secure_aggregation == "he" else [])
    return [{"tasks": task_names(plan), "filters": filters}] if filters else []


def _recorder(direction: str) -> dict[str, Any]:
    return {"path": "medflare.flare.audit.PayloadRecorder", "args": {"direction": direction}}


def meta_config(plan: RunPlan) -> dict[str, Any]:
    """meta.json: one app deployed to every participant, under the method's privacy scope."""
    return {
        "name": plan.job_name,
        # Sites with a privacy policy apply this scope's result filters (the method's Payload guard);
        # FLARE ignores it where no policy is defined (simulator, plain POC).
        "scope": privacy_scope(plan.method),
        "resource_spec": {},
        "min_clients": plan.min_clients,
        "deploy_map": {APP_NAME: ["@ALL"]},
        # For whoever reviews the job: FLARE keeps unknown meta keys and ignores them
        "robust_aggregation": plan.defences.record(),
        **({"secure_aggregation": plan.secure_aggregation} if plan.secure_aggregation != "off" else {}),
    }


def write_job(plan: RunPlan, out_dir: str | Path, mode: str = "byoc") -> Path:
    """Write the job of ``plan`` (:func:`medflare.plan.resolve`) to ``out_dir/<job name>/`` and return its path; a
    BYOC job carries medflare's job package (no console) and the plan's plugin modules (their source, as this
    process imported them). An existing folder is replaced once the new one is complete, and only if it holds just
    what medflare recorded writing there (:func:`medflare.console.files.write_recorded`; else OutputError)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got '{mode}'")
    if plan.plugins and mode != "byoc":  # refused before anything is written
        raise ConfigError(f"plugin files ship inside the job ({', '.join(plan.plugins)}), so they need --mode byoc; "
                          "for a pre-installed site, install them as a package (docs/own-model-and-data.md)")
    return write_recorded(Path(out_dir), plan.job_name, lambda staging: _write_job(plan, staging, mode))


def _write_job(plan: RunPlan, staging: Path, mode: str) -> None:
    """The job's files (meta, plan, configs, and for BYOC the code) into the empty ``staging``."""
    config_dir = staging / APP_NAME / "config"
    config_dir.mkdir(parents=True)
    write_plan(plan, config_dir)
    _write_json(config_dir / "config_fed_server.json", server_config(plan))
    _write_json(config_dir / "config_fed_client.json", client_config(plan))
    if mode == "byoc":
        copy_job_package(staging / APP_NAME / "custom" / "medflare")
        _copy_plugins(list(plan.plugins), staging / APP_NAME / "custom")
    # last: the digest of the code just written (a site approves it; it computes the digest again itself)
    _write_json(staging / "meta.json", {**meta_config(plan), META_KEY: code_digest(staging / APP_NAME / "custom")})


def job_code_digest(job_dir: str | Path) -> str:
    """The digest of the code a written job brings (:func:`medflare.job_code.code_digest` of its app/custom)."""
    return code_digest(Path(job_dir) / APP_NAME / "custom")


def _copy_plugins(modules: list[str], custom_dir: Path) -> None:
    """Plugin modules go to app/custom/medflare_plugins/, the package the job's components import them from: the
    source this process loaded each from (the resolver imported them, so the job runs the code that was checked)."""
    if not modules:
        return
    from medflare.registry import PLUGIN_PACKAGE, load_plugins

    load_plugins(modules)
    package = custom_dir / PLUGIN_PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text('"""Methods this job brings along (medflare plugins)."""\n')
    for module in modules:
        shutil.copy(sys.modules[module].__file__, package / (module.rsplit(".", 1)[1] + ".py"))


def set_resume(job_dir: str | Path, previous_job_id: str) -> Path:
    """Make the job at ``job_dir`` continue from the last round ``previous_job_id`` (same server) completed."""
    set_plan_resume(job_dir, previous_job_id)
    return Path(job_dir)


def copy_job_package(target: Path) -> None:
    """Copy the job package (medflare without its console and without caches) to ``target``."""
    shutil.copytree(PACKAGE_DIR, target, ignore=_not_shipped)


def _not_shipped(directory: str, names: list[str]) -> list[str]:
    console = [CONSOLE_DIR.name] if Path(directory).resolve() == PACKAGE_DIR else []
    return console + [n for n in names if n == "__pycache__" or n.endswith(".pyc")]


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=False) + "\n")
