"""Task names and the round header the server puts into every task."""

from __future__ import annotations

from typing import Any, Mapping

from medflare import contracts
from medflare.methods.base import RoundContext

TASK_TRAIN = "train"
TASK_VALIDATE = "validate"
TASK_SUBMIT_MODEL = "submit_model"


def round_meta(ctx: RoundContext) -> dict[str, Any]:
    """Server -> site meta for a task."""
    return {
        contracts.ROUND: ctx.round,
        contracts.TOTAL_ROUNDS: ctx.total_rounds,
        contracts.STAGE: ctx.stage,
        **dict(ctx.server_meta),
    }


def round_context(meta: Mapping[str, Any]) -> RoundContext:
    """Site-side decode of :func:`round_meta`."""
    header = {contracts.ROUND, contracts.TOTAL_ROUNDS, contracts.STAGE}
    return RoundContext(
        round=int(meta.get(contracts.ROUND, 0)),
        total_rounds=int(meta.get(contracts.TOTAL_ROUNDS, 1)),
        stage=str(meta.get(contracts.STAGE, "train")),
        server_meta={k: v for k, v in meta.items() if k not in header},
    )
