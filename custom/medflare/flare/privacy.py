"""FLARE's differential-privacy result filters, made safe for medflare's updates.

FLARE's ``PercentilePrivacy`` and ``SVTPrivacy`` sparsify, clip and noise *weight differences*: applied to absolute
weights they would silently destroy the model, and integer buffers trip them up. ``UpdatePrivacy`` applies one only
to a result of differences (``transfer_kind=diff``) and refuses any other weight result, saying what to change.
"""

from __future__ import annotations

from nvflare.apis.dxo import DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy
from nvflare.app_common.filters.svt_privacy import SVTPrivacy

from medflare.errors import PayloadError

FILTERS = {"percentile": PercentilePrivacy, "svt": SVTPrivacy}


class UpdatePrivacy(Filter):
    """Applies FLARE's ``PercentilePrivacy`` or ``SVTPrivacy`` to weight differences, and only to them.

    Args:
        filter: "percentile" (Shokri & Shmatikov: only the largest differences, clipped to gamma) or "svt".
        args: the FLARE filter's own arguments, e.g. {"percentile": 10, "gamma": 0.01} (a site's privacy policy).
        plan_file: a job's plan, whose ``dp`` section gives both instead (a job's filter takes nothing else).
    """

    def __init__(self, filter: str = "percentile", args: dict | None = None,  # noqa: A002 (config key)
                 plan_file: str = "") -> None:
        super().__init__()
        self.plan_file = plan_file
        self._dp: Filter | None = None if plan_file else _flare_filter(filter, args or {})

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if self._dp is None:
            from medflare.flare.tasks import deployed_plan  # local: a site's own filter needs no plan

            dp = deployed_plan(fl_ctx, self.plan_file)[0].dp_filter  # typed once, where the plan was read
            if dp is None:
                raise PayloadError("the job's plan has no dp section, but its configuration names UpdatePrivacy with "
                                   "plan_file: export the job again")
            self._dp = _flare_filter(dp.filter, dict(dp.args))
        if shareable.get_return_code() not in (None, ReturnCode.OK):
            return shareable
        kind = from_shareable(shareable).data_kind
        if kind == DataKind.WEIGHTS:
            raise PayloadError(
                "this site's privacy policy applies a differential-privacy filter, which needs updates sent as "
                "differences: run the job with transfer_kind=diff (--set transfer_kind=diff)"
            )
        return self._dp.process(shareable, fl_ctx) if kind == DataKind.WEIGHT_DIFF else shareable


def _flare_filter(name: str, args: dict) -> Filter:
    """FLARE's DP filter ``name`` with its ``args``, acting on weight differences only."""
    if name not in FILTERS:
        raise ValueError(f"UpdatePrivacy filter must be one of {sorted(FILTERS)}, got '{name}'")
    return FILTERS[name](**{**args, "data_kinds": [DataKind.WEIGHT_DIFF]})

