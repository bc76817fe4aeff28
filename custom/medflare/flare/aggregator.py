"""The server-side FLARE aggregator: validates every incoming update, then applies the method's ServerRule."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator

from medflare.config import from_dict
from medflare.contracts import ContractContext, validate_update
from medflare.errors import MedflareError
from medflare.methods.base import AggregateResult, RoundContext, ServerRule, SiteUpdate
from medflare.registry import get_method

SHARES = "shares"
INFO = "info"


class RoundAggregation:
    """FLARE-free core of one round: accept (validate) updates, then aggregate. Testable on its own."""

    def __init__(self, method: str, method_args: Mapping[str, Any] | None, num_classes: int, num_rounds: int):
        self.spec = get_method(method)
        method_cfg = from_dict(self.spec.config_cls, dict(method_args or {}), f"method '{method}'")
        self.rule: ServerRule = self.spec.server_rule_cls(method_cfg, num_rounds)
        self.contract_ctx = ContractContext(num_classes=num_classes)
        self.global_params: dict[str, np.ndarray] = {}
        self.ctx = RoundContext(round=0, total_rounds=num_rounds)
        self.phase = "train"
        self.expected: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.updates: dict[str, SiteUpdate] = {}
        self.rejected: dict[str, str] = {}
        self.earlier: dict[str, list[SiteUpdate]] = {}  # this round's completed phases

    def start_round(self, global_params: Mapping[str, np.ndarray], ctx: RoundContext) -> None:
        """Forget the previous round."""
        self.global_params = {k: np.asarray(v) for k, v in global_params.items()}
        self.ctx = ctx
        self.earlier, self.updates, self.rejected, self.phase = {}, {}, {}, ""

    def start_phase(self, phase: str) -> dict[str, np.ndarray]:
        """Begin a phase of the round: returns the arrays to send and fixes what valid results look like."""
        if self.phase:
            self.earlier[self.phase] = self.accepted()
        self.phase = phase
        self.updates, self.rejected = {}, {}
        self.expected = self.rule.expected_arrays(phase, self.global_params, self.spec.payload)
        return self.rule.phase_arrays(phase, self.global_params, self.earlier)

    def expected_arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """key -> (shape, dtype) a valid result of the current phase carries."""
        return self.expected

    def accepted(self) -> list[SiteUpdate]:
        """Accepted updates of the current phase, in site-name order (for reproducibility)."""
        return [self.updates[site] for site in sorted(self.updates)]

    def accept(self, site: str, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> str | None:
        """Validate and keep one site's update. Returns None when accepted, else the rejection reason."""
        if site in self.updates:
            reason = "a second update in the same round"
        else:
            try:
                clean, clean_meta = validate_update(
                    arrays, meta, self.expected_arrays(), self.spec.payload, self.contract_ctx
                )
                if self.phase == "train":  # the aggregation weight must be computable
                    self.rule.site_weight(SiteUpdate(site, clean, clean_meta), self.ctx)
                self.updates[site] = SiteUpdate(site, clean, clean_meta)
                return None
            except (MedflareError, KeyError, TypeError, ValueError) as exc:
                reason = str(exc) or type(exc).__name__
        self.rejected[site] = reason
        return reason

    def aggregate(self) -> AggregateResult:
        """The next global model from the last phase's accepted updates."""
        return self.rule.aggregate(self.global_params, self.accepted(), self.ctx)


class MedflareAggregator(Aggregator):
    """FLARE Aggregator adapter over :class:`RoundAggregation`; one instance serves every method.

    Args:
        method: registered method name.
        num_classes: class count declared by the job (validates per-class vectors).
        num_rounds: total rounds (some server rules schedule by round).
        method_args: the method's hyperparameters (the server rule reads its own).
    """

    def __init__(self, method: str, num_classes: int, num_rounds: int, method_args: dict | None = None) -> None:
        super().__init__()
        self.method = method
        self.num_classes = num_classes
        self.num_rounds = num_rounds
        self.method_args = method_args or {}
        self.core = RoundAggregation(method, self.method_args, num_classes, num_rounds)

    def start_round(self, global_params: Mapping[str, np.ndarray], ctx: RoundContext) -> None:
        """Called by the controller before it sends the round's first task."""
        self.core.start_round(global_params, ctx)

    def start_phase(self, phase: str) -> dict[str, np.ndarray]:
        """Called by the controller before each phase; returns the arrays to send."""
        return self.core.start_phase(phase)

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, default="?")
        try:
            dxo = from_shareable(shareable)
            reason = self.core.accept(site, dxo.data or {}, dxo.meta or {})
        except Exception as exc:  # a result that is not even a DXO is a rejected update, not a crash
            reason = f"not a valid DXO: {exc}"
            self.core.rejected[site] = reason
        if reason:
            self.log_warning(
                fl_ctx, f"round {self.core.ctx.round + 1}: REJECTED update from {site}: {reason}. "
                "The round goes on without it; check that site's log."
            )
            return False
        return True

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        result = self.core.aggregate()
        return DXO(DataKind.WEIGHTS, data=result.params, meta={SHARES: result.shares, INFO: result.info}).to_shareable()

    def reset(self, fl_ctx: FLContext) -> None:
        self.core.start_round(self.core.global_params, self.core.ctx)
