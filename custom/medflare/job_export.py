"""Write a FLARE job folder for any registered method: one builder for every method and every environment.

Two deployment modes:
- ``byoc``: the job carries the medflare package in ``app/custom/`` (needs the submitter's BYOC right).
- ``preinstalled``: the job carries configs only; sites run a reviewed, pip-installed medflare and allow-list
  exactly the ``medflare.flare.`` components named here in their ``local/resources.json``
  (:mod:`medflare.deploy.policies`).

Every job for a real deployment gets the server's robust defences (``run_config.DEPLOY_ROBUST`` under the run's own
``robust`` settings); only a BYOC job with simulated data, the kind FLARE's simulator runs, keeps the run's settings
as they are. meta.json records which defences are on.

This module writes files, so it lives outside ``medflare.flare``: nothing a job can name may have side effects.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from medflare.checkpoint import checkpoint_facts
from medflare.contracts import TRAIN_PHASE as TASK_TRAIN, privacy_scope
from medflare.errors import ConfigError
from medflare.evaluation import headline_metric
from medflare.flare import tracking
from medflare.plan import APP_NAME, DEFAULT_TASK_TIMEOUT, ENCRYPTED_AGGREGATOR, round_steps
from medflare.registry import get_method
from medflare.run_config import ROBUST_OFF, RunConfig, deployment_robust, typed_robust
from medflare.site_runtime import TaskSpec

PACKAGE_DIR = Path(__file__).resolve().parent  # .../custom/medflare
MODES = ("byoc", "preinstalled")




def multi_label_args(task: TaskSpec) -> dict[str, Any]:
    """{"multi_label": True} for a multi-label task, else nothing (single-label job configs stay as they were)."""
    return {"multi_label": True} if task.multi_label else {}


def server_config(run: RunConfig, task: TaskSpec, shot_groups: dict | None = None) -> dict[str, Any]:
    """config_fed_server.json: the (FLARE PT) model persistor, the medflare aggregator and controller, and the
    experiment-tracking receivers."""
    model_args = {
        "method": run.method,
        "model": run.model,
        "num_classes": task.num_classes,
        "in_channels": task.in_channels,
        "image_size": task.image_size,
        "pretrained": run.pretrained,
        "method_args": run.method_args,
        "seed": run.seed,
        "plugins": run.plugin_modules(),
        **({"dp_sgd": True} if run.dp_sgd else {}),  # the sites' DP-compatible architecture
    }
    config: dict[str, Any] = {
        "format_version": 2,
        # FLARE's default 2 s polling interval dominates short rounds; 0.1 s is safe on loopback and LAN.
        "server": {"heart_beat_timeout": 600, "task_request_interval": run.task_request_interval},
        "task_data_filters": [],
        "task_result_filters": [],
        "components": [
            {
                "id": "persistor",
                "path": "medflare.flare.persistor.MedflareModelPersistor",
                "args": {
                    "model": {"path": "medflare.flare.models.build_global_model", "args": model_args},
                    "facts": checkpoint_facts(run, task),  # saved inside every global model file
                },
            },
            {
                "id": "aggregator",
                "path": aggregator_path(run),
                "args": {
                    "method": run.method,
                    "num_classes": task.num_classes,
                    "num_rounds": run.rounds,
                    "method_args": run.method_args,
                    "robust": typed_robust(run.robust),
                    "transfer_dtype": run.transfer_dtype,
                    "transfer_kind": run.transfer_kind,
                    "stream_aggregation": run.stream_aggregation,
                    "plugins": run.plugin_modules(),
                    **multi_label_args(task),
                    **download_args(run),
                },
            },
            *tracking.server_components(run.tracking, mlflow_args(run)),
        ],
        "workflows": [
            {
                "id": "controller",
                "path": "medflare.flare.controller.MedflareController",
                "args": {
                    "num_rounds": run.rounds,
                    "min_clients": run.required_clients,
                    "persistor_id": "persistor",
                    "aggregator_id": "aggregator",
                    "shot_groups": shot_groups,
                    "wait_time_after_min_received": run.straggler_seconds,
                    "train_timeout": run.task_timeout or DEFAULT_TASK_TIMEOUT,
                    "patience": run.patience,
                    **({"key_metric": headline_metric(True)} if task.multi_label else {}),
                },
            }
        ],
    }
    if run.resume_from:  # the controller reads the model and history (a folder in the simulator, else a job id)
        config["workflows"][0]["args"]["resume_from"] = run.resume_from
    return config


def aggregator_path(run: RunConfig) -> str:
    """The server's aggregator: medflare's, or its encrypted twin (secure_aggregation=he, same arguments)."""
    if run.secure_aggregation == "he":
        return ENCRYPTED_AGGREGATOR
    return "medflare.flare.aggregator.MedflareAggregator"


def download_args(run: RunConfig) -> dict[str, Any]:
    """The aggregator's ``download_dtype`` when the run narrows the download; a job that keeps the default writes
    the configuration it always did (and the generated apps and templates stay as they are)."""
    return {"download_dtype": run.download_dtype} if run.download_dtype != "float32" else {}


def mlflow_args(run: RunConfig) -> dict[str, Any] | None:
    """What the MLflow receiver records of the job (None without it): the experiment (``MLFLOW_EXPERIMENT_NAME``,
    MLflow's own variable, where the job is written, else "medflare"), the run's name ``<method>-<model>-s<seed>``
    and the run's effective settings as params, each named as its ``--set`` key (``train.lr``, ``method.mu``)."""
    if "mlflow" not in tracking.TRACKERS[run.tracking]:
        return None
    method_config = get_method(run.method).config_cls(**run.method_args)
    params = {
        **{key: getattr(run, key) for key in ("method", "model", "pretrained", "rounds", "clients", "seed")},
        "min_clients": run.required_clients,
        **{f"data.{key}": value for key, value in run.data.items()},
        **{f"train.{key}": value for key, value in dataclasses.asdict(run.train_config()).items()},
        **{f"method.{key}": value for key, value in dataclasses.asdict(method_config).items()},
    }
    # a deployed job that brings its own (simulated) data runs only at sites that opted in to such data: a POC's
    deployed_env = "prod" if run.data.get("source", "site") == "site" else "poc"
    return tracking.mlflow_receiver_args(
        params, run_name=f"{run.method}-{run.model}-s{run.seed}", tags={"method": run.method, "model": run.model},
        deployed_env=deployed_env, experiment=os.environ.get("MLFLOW_EXPERIMENT_NAME", ""),
    )


def client_config(run: RunConfig, task: TaskSpec) -> dict[str, Any]:
    """config_fed_client.json: the medflare executor for every task."""
    return {
        "format_version": 2,
        "executors": [
            {
                "tasks": ["*"],  # train, validate, submit_model and any method-specific phase
                "executor": {
                    "id": "executor",
                    "path": "medflare.flare.executor.MedflareExecutor",
                    "args": {
                        "method": run.method,
                        "task": {
                            "num_classes": task.num_classes,
                            "in_channels": task.in_channels,
                            "image_size": task.image_size,
                            **multi_label_args(task),
                        },
                        "model": run.model,
                        "method_args": run.method_args,
                        "train": run.train,
                        "data": run.site_data(),
                        "sites": run.site_names,
                        "seed": run.seed,
                        "site_train": run.site_train,
                        "evaluation": run.site_evaluation,
                        "site_model": run.site_model,
                        "plugins": run.plugin_modules(),
                        "stream_metrics": bool(tracking.TRACKERS[run.tracking]),
                        **({"dp_sgd": run.dp_sgd} if run.dp_sgd else {}),
                    },
                },
            }
        ],
        "task_result_filters": _result_filters(run, task),
        "task_data_filters": _data_filters(run, task),
        "components": tracking.client_components(run.tracking),
    }


def task_names(run: RunConfig, task: TaskSpec | None = None) -> list[str]:
    """Every task name the job's server sends: the rule's phases over all rounds, validate and submit_model."""
    from medflare.flare.tasks import TASK_SUBMIT_MODEL, TASK_VALIDATE

    steps = round_steps(run.method, run.method_args, run.rounds, bool(task and task.multi_label))
    return sorted({phase for step in steps for phase in step.phases} | {TASK_VALIDATE, TASK_SUBMIT_MODEL})


def _result_filters(run: RunConfig, task: TaskSpec) -> list[dict[str, Any]]:
    """The job's DP filter on train results (if asked), the encryption of the results that carry the model
    (secure_aggregation=he), then the audit recorder, so it records what really leaves.

    FLARE allows one filter chain per task, so each task's filters form one chain, in order (a site's own privacy
    filters run before them: the site checks its plaintext update before it is encrypted).
    """
    from medflare.flare.tasks import TASK_SUBMIT_MODEL

    dp = {"path": "medflare.flare.privacy.UpdatePrivacy", "args": run.dp} if run.dp else None
    seal = _encryption_filter(run) if run.secure_aggregation == "he" else None
    chains = []
    for name in task_names(run, task):
        filters = ([dp] if dp and name == TASK_TRAIN else []) + \
            ([seal] if seal and name in (TASK_TRAIN, TASK_SUBMIT_MODEL) else []) + \
            ([_recorder("result")] if run.audit else [])
        if filters:
            chains.append({"tasks": [name], "filters": filters})
    return chains


def _encryption_filter(run: RunConfig) -> dict[str, Any]:
    """The site filter that encrypts a result's model arrays: the method's declared arrays (its rule weighs sites by
    them) and frozen parts (sent back as received) stay in plaintext."""
    payload = get_method(run.method).payload
    return {"path": "medflare.flare.he.EncryptResult",
            "args": {"plain": sorted(payload.arrays_for(TASK_TRAIN)), "plain_keys": payload.frozen_keys or ""}}


def _data_filters(run: RunConfig, task: TaskSpec) -> list[dict[str, Any]]:
    """On every task: the audit recorder (what arrives, ciphertexts as they are), then the decryption of the
    global model (secure_aggregation=he)."""
    filters = ([_recorder("task")] if run.audit else []) + \
        ([{"path": "medflare.flare.he.DecryptTask", "args": {}}] if run.secure_aggregation == "he" else [])
    return [{"tasks": task_names(run, task), "filters": filters}] if filters else []


def _recorder(direction: str) -> dict[str, Any]:
    return {"path": "medflare.flare.audit.PayloadRecorder", "args": {"direction": direction}}


def meta_config(run: RunConfig) -> dict[str, Any]:
    """meta.json: one app deployed to every participant, under the method's privacy scope."""
    return {
        "name": run.job_name,
        # Sites with a privacy policy apply this scope's result filters (the method's Payload guard);
        # FLARE ignores it where no policy is defined (simulator, plain POC).
        "scope": privacy_scope(run.method),
        "resource_spec": {},
        "min_clients": run.required_clients,
        "deploy_map": {APP_NAME: ["@ALL"]},
        # For whoever reviews the job: FLARE keeps unknown meta keys and ignores them
        "robust_aggregation": robust_record(run.robust),
        **({"secure_aggregation": run.secure_aggregation} if run.secure_aggregation != "off" else {}),
    }


def robust_record(robust: dict[str, Any]) -> dict[str, Any]:
    """Whether the server's robust defences are on, and with which values (0 = that defence is off)."""
    settings = {**ROBUST_OFF, **typed_robust(robust)}
    return {"on": any(settings.values()), **settings}


def simulator_job(run: RunConfig, mode: str) -> bool:
    """A BYOC job with simulated data is what FLARE's simulator runs; any other job can only be deployed (a
    pre-installed job needs sites that allow-listed medflare, site data needs a hospital's own config)."""
    return mode == "byoc" and run.data.get("source", "site") != "site"


def job_robust(run: RunConfig, mode: str) -> dict[str, float]:
    """The robust settings a job written in ``mode`` carries: the run's own in a simulator job, else the deployment
    defaults under them (a POC run with simulated data is a deployment too: ``deploy.poc`` says so first)."""
    encrypted = run.secure_aggregation == "he"
    return typed_robust(run.robust) if simulator_job(run, mode) else deployment_robust(run.robust, encrypted)


def export_job(
    run: RunConfig, out_dir: str | Path, task: TaskSpec, mode: str = "byoc", shot_groups: dict | None = None
) -> Path:
    """Write ``out_dir/<job name>/`` and return its path. An existing folder of that name is replaced.

    The job's robust settings are :func:`job_robust`'s (``run`` itself is not changed).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got '{mode}'")
    if run.plugins and mode != "byoc":  # refused before anything is written
        raise ConfigError(f"plugin files ship inside the job ({', '.join(map(str, run.plugins))}), so they need "
                          "--mode byoc; for a pre-installed site, install them as a package (docs/own-model-and-data.md)")
    run = dataclasses.replace(run, robust=job_robust(run, mode))
    job_dir = Path(out_dir) / run.job_name
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    # A new folder made exclusively: a planted `<job>.partial` (or a symlink of that name) is never written through
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".{run.job_name}.", suffix=".partial"))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the job from whoever submits or reviews it
    try:
        _write_job(run, staging, task, mode, shot_groups)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if job_dir.is_symlink():  # replace the link itself, never the folder it points to
        job_dir.unlink()
    shutil.rmtree(job_dir, ignore_errors=True)
    staging.rename(job_dir)  # only a complete job folder ever appears under its real name
    return job_dir


def _write_job(run: RunConfig, staging: Path, task: TaskSpec, mode: str, shot_groups: dict | None) -> None:
    """The job's files (meta, server and client configs, and for BYOC the code) into the empty ``staging``."""
    config_dir = staging / APP_NAME / "config"
    config_dir.mkdir(parents=True)
    _write_json(staging / "meta.json", meta_config(run))
    _write_json(config_dir / "config_fed_server.json", server_config(run, task, shot_groups))
    _write_json(config_dir / "config_fed_client.json", client_config(run, task))
    if mode == "byoc":
        shutil.copytree(PACKAGE_DIR, staging / APP_NAME / "custom" / "medflare", ignore=_ignore_caches)
        _copy_plugins(run, staging / APP_NAME / "custom")


def _copy_plugins(run: RunConfig, custom_dir: Path) -> None:
    """Plugin files go to app/custom/medflare_plugins/, the package the job's components import them from."""
    if not run.plugins:
        return
    from medflare.registry import PLUGIN_PACKAGE

    package = custom_dir / PLUGIN_PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text('"""Methods this job brings along (medflare plugins)."""\n')
    for path, module in zip(run.plugins, run.plugin_modules()):
        shutil.copy(path, package / (module.rsplit(".", 1)[1] + ".py"))


def set_resume(job_dir: str | Path, previous_job_id: str) -> Path:
    """Make the job at ``job_dir`` continue from the last round an earlier run of it (``previous_job_id``, on the
    same server) completed, e.g. after the server crashed. Returns ``job_dir``."""
    path = Path(job_dir) / APP_NAME / "config" / "config_fed_server.json"
    config = json.loads(path.read_text())
    config["workflows"][0]["args"]["resume_from"] = previous_job_id
    _write_json(path, config)
    return Path(job_dir)


def _ignore_caches(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or n.endswith(".pyc")]


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=False) + "\n")
