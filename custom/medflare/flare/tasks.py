"""Task names, the round header the server puts into every task (the round plan: ``server_setup.round_plan``), and
the job's plan as a participant loads it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext

from medflare import contracts
from medflare.errors import ConfigError
from medflare.methods.base import RoundContext
from medflare.plan import PLAN_FILE, RunPlan, read_plan

TASK_TRAIN = contracts.TRAIN_PHASE
TASK_VALIDATE = "validate"
TASK_SUBMIT_MODEL = "submit_model"


# RoundContext field -> (its key in a task's meta, its type, its value when a task does not carry it)
HEADER = {"round": (contracts.ROUND, int, 0), "total_rounds": (contracts.TOTAL_ROUNDS, int, 1),
          "stage": (contracts.STAGE, str, contracts.TRAIN_PHASE), "stage_round": (contracts.STAGE_ROUND, int, -1),
          "stage_rounds": (contracts.STAGE_ROUNDS, int, 0), "scored": (contracts.SCORED, bool, True)}


def round_meta(ctx: RoundContext) -> dict[str, Any]:
    """Server -> site meta for a task."""
    return {**dict(ctx.server_meta), **{key: getattr(ctx, field) for field, (key, _, _) in HEADER.items()}}


def round_context(meta: Mapping[str, Any]) -> RoundContext:
    """Site-side decode of :func:`round_meta`; every other key (array dims, transfer dtype, rule meta) is
    kept in ``server_meta``."""
    keys = {key for key, _, _ in HEADER.values()}
    return RoundContext(**{field: kind(meta.get(key, default)) for field, (key, kind, default) in HEADER.items()},
                        server_meta={k: v for k, v in meta.items() if k not in keys})


# plan file (path, mtime, size) -> its plan and its log line: the server's components and a site's executor and
# filters (which ask on every result) load and fingerprint it once per process
_LOADED: dict[tuple[str, int, int], tuple[RunPlan, str]] = {}


def deployed_plan(fl_ctx: FLContext, plan_file: str = PLAN_FILE) -> tuple[RunPlan, str]:
    """The running job's plan, from the ``plan_file`` FLARE deployed in this participant's app config folder, and
    a line for the log: its fingerprint, and whether it was edited since it was written. A :class:`ConfigError`
    when ``plan_file`` is not a plain file name, or the file is missing, unreadable or invalid."""
    if not plan_file or os.path.basename(plan_file) != plan_file or plan_file in (".", ".."):
        raise ConfigError(f"plan_file must name a file in the job's app/config folder, got '{plan_file}'")
    app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)  # the participant's deployed app (its config folder inside)
    engine = fl_ctx.get_engine()
    if not app_root and engine is not None:
        app_root = engine.get_workspace().get_app_dir(fl_ctx.get_job_id())
    if not app_root:
        raise ConfigError("this FLARE context names no deployed app, so no job plan")
    path = Path(app_root) / "config" / plan_file
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"the job has no plan: {path} ({exc.strerror}); export it with medflare") from exc
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _LOADED:
        plan, written = read_plan(path)
        digest = plan.digest()
        edited = f" (edited since it was written as {written})" if written != digest else ""
        _LOADED[key] = plan, f"runs plan {digest}{edited} (medflare config --plan prints it)"
    return _LOADED[key]
