"""Task names, the round header the server puts into every task (the round plan: ``server_setup.round_plan``), and
the job's plan as a participant rebuilds it."""

from __future__ import annotations

from typing import Any, Mapping

from nvflare.apis.fl_context import FLContext

from medflare import contracts
from medflare.methods.base import RoundContext
from medflare.plan import RunPlan, plan_from_app

TASK_TRAIN = contracts.TRAIN_PHASE
TASK_VALIDATE = "validate"
TASK_SUBMIT_MODEL = "submit_model"


def round_meta(ctx: RoundContext) -> dict[str, Any]:
    """Server -> site meta for a task."""
    return {
        **dict(ctx.server_meta),
        contracts.ROUND: ctx.round,
        contracts.TOTAL_ROUNDS: ctx.total_rounds,
        contracts.STAGE: ctx.stage,
        contracts.STAGE_ROUND: ctx.stage_round,
        contracts.STAGE_ROUNDS: ctx.stage_rounds,
        contracts.SCORED: ctx.scored,
    }


HEADER_KEYS = (
    contracts.ROUND, contracts.TOTAL_ROUNDS, contracts.STAGE, contracts.STAGE_ROUND, contracts.STAGE_ROUNDS,
    contracts.SCORED,
)


def round_context(meta: Mapping[str, Any]) -> RoundContext:
    """Site-side decode of :func:`round_meta`; every other key (array dims, transfer dtype, rule meta) is
    kept in ``server_meta``."""
    return RoundContext(
        round=int(meta.get(contracts.ROUND, 0)),
        total_rounds=int(meta.get(contracts.TOTAL_ROUNDS, 1)),
        stage=str(meta.get(contracts.STAGE, contracts.TRAIN_PHASE)),
        stage_round=int(meta.get(contracts.STAGE_ROUND, -1)),
        stage_rounds=int(meta.get(contracts.STAGE_ROUNDS, 0)),
        scored=bool(meta.get(contracts.SCORED, True)),
        server_meta={k: v for k, v in meta.items() if k not in HEADER_KEYS},
    )


def deployed_plan(fl_ctx: FLContext) -> RunPlan:
    """The running job's plan, rebuilt from the app and meta FLARE deployed to this participant (the server and
    every site alike), as the command line and ``medflare config --plan`` built it.

    Raises:
        ConfigError: the job's configs are unreadable, not a medflare job, or disagree between server and sites.
    """
    workspace, job_id = fl_ctx.get_engine().get_workspace(), fl_ctx.get_job_id()
    return plan_from_app(workspace.get_app_config_dir(job_id), workspace.get_job_meta_path(job_id))
