"""FLARE's differential-privacy result filters, made safe for medflare's updates.

FLARE's ``PercentilePrivacy`` and ``SVTPrivacy`` sparsify, clip and noise *weight differences*. Applied to
absolute weights they would silently destroy the model, and integer buffers trip them up. ``UpdatePrivacy``
applies the chosen FLARE filter only to a result that carries differences (``transfer_kind=diff``; integer
buffers then stay at the site) and refuses any other weight result with a message saying what to change. A
site names it in its privacy policy (``local/privacy.json``), or a job in its client config.
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
        filter: "percentile" (Shokri & Shmatikov: share only the largest differences, clipped to gamma) or "svt"
            (sparse vector technique).
        args: the FLARE filter's own arguments, e.g. {"percentile": 10, "gamma": 0.01}.
    """

    def __init__(self, filter: str = "percentile", args: dict | None = None) -> None:  # noqa: A002 (config key)
        super().__init__()
        if filter not in FILTERS:
            raise ValueError(f"UpdatePrivacy filter must be one of {sorted(FILTERS)}, got '{filter}'")
        self.filter = filter
        self.args = args or {}
        self._dp = FILTERS[filter](**{**self.args, "data_kinds": [DataKind.WEIGHT_DIFF]})

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if shareable.get_return_code() not in (None, ReturnCode.OK):
            return shareable
        kind = from_shareable(shareable).data_kind
        if kind == DataKind.WEIGHTS:
            raise PayloadError(
                "this site's privacy policy applies a differential-privacy filter, which needs updates sent as "
                "differences: run the job with transfer_kind=diff (--set transfer_kind=diff)"
            )
        return self._dp.process(shareable, fl_ctx) if kind == DataKind.WEIGHT_DIFF else shareable

