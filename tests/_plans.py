"""A job's plan where FLARE deploys it (``app/config/medflare_plan.json``), for tests that build medflare's FLARE
components by hand: each component reads the plan from the app folder its FLARE context names."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext

from medflare.console.job_export import write_job
from medflare.plan import RunPlan, build_plan, resolve, task_of, validated, write_plan
from medflare.run_config import RunConfig
from medflare.site_config import TaskSpec


def site_data_plan(method: str = "fedavg", num_classes: int = 2, rounds: int = 3, multi_label: bool = False,
                   clients: int = 2, **changes: Any) -> RunPlan:
    """The plan of a ``method`` job of ``rounds`` rounds whose ``clients`` sites read their own data, on a declared
    task (1 channel, 28 px); ``changes``: plan fields to replace (``min_clients``, ``patience``, ``robust``, ...)."""
    plan = _site_data_plan(method, num_classes, rounds, multi_label, clients)
    return dataclasses.replace(plan, **changes) if changes else plan


@functools.cache
def _site_data_plan(method: str, num_classes: int, rounds: int, multi_label: bool, clients: int) -> RunPlan:
    task = {"num_classes": num_classes, "in_channels": 1, "image_size": 28, "multi_label": multi_label,
            "class_names": [f"class_{k}" for k in range(num_classes)]}  # every job names its classes
    run = RunConfig(method=method, data={"source": "site"}, task=task, rounds=rounds, clients=clients)
    run = validated(run, check_files=False)
    return build_plan(run, task_of(run), {})


def run_plan(run: RunConfig) -> RunPlan:
    """The plan of a validated (or valid) ``run``, with the run's own robust settings."""
    run = validated(run, check_files=False)
    return build_plan(run, task_of(run), run.robust)


def write_run_job(run: RunConfig, out_dir: Path, task: TaskSpec | None = None, mode: str = "byoc") -> Path:
    """The job ``medflare export --mode MODE`` writes for the layered ``run`` (its plan: ``plan.resolve``, the
    weights file unchecked as export leaves it), in ``out_dir/<job name>/``."""
    return write_job(resolve(run, mode, task=task, check_files=False), out_dir, mode)


def deploy_plan(app: Path, plan: RunPlan) -> Path:
    """``plan`` as the job's plan in the app folder ``app`` (created); returns ``app``."""
    (app / "config").mkdir(parents=True, exist_ok=True)
    write_plan(plan, app / "config")
    return app


def app_context(app: Path, ctx: FLContext | None = None) -> FLContext:
    """A FLARE context whose participant runs the app in ``app`` (``ctx``, or a new one)."""
    ctx = ctx or FLContext()
    ctx.set_prop(FLContextKey.APP_ROOT, str(app), private=True, sticky=False)
    return ctx
