"""Site-enforced privacy filters: what a site lets leave it, decided by the site's own ``local/privacy.json``.

The method's code already refuses to send undeclared keys (``Payload.check_outgoing``). These filters repeat
the check *outside* the job, as FLARE task-result filters configured by the hospital, so a pre-installed site
enforces the reviewed declaration even if a job's configuration asks for something else.
"""

from __future__ import annotations

import json
import os
from typing import Any

from nvflare.apis.dxo import from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare.contracts import Payload
from medflare.errors import PayloadError

CLIENT_CONFIG = "config_fed_client.json"


class PayloadGuard(Filter):
    """Refuses any task result that carries a key the method's Payload does not declare.

    Every result is checked, including results with no arrays (a DXOFilter would skip those). Raising makes
    FLARE replace the result with an error reply, so nothing undeclared reaches the server.

    Args:
        method: the registered method whose declaration applies; "" reads it from the job's client config
            (used by the default scope, so a job that names no scope is still checked).
    """

    def __init__(self, method: str = "") -> None:
        super().__init__()
        self.method = method

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if shareable.get_return_code() != ReturnCode.OK:
            return shareable  # an error reply carries nothing
        dxo = from_shareable(shareable)
        payload = _payload(self.method or job_method(fl_ctx))
        check_result_keys(payload, list((dxo.data or {}).keys()), list((dxo.meta or {}).keys()))
        return shareable  # unchanged: this filter only allows or refuses


def check_result_keys(payload: Payload, array_keys: list[str], meta_keys: list[str]) -> None:
    """Raise PayloadError if a result would send a private array, an undeclared array or undeclared meta.

    Args:
        payload: the method's declaration.
        array_keys: names of the arrays in the result.
        meta_keys: names of the meta entries in the result.
    """
    private = sorted(k for k in array_keys if payload.is_private(k))
    if private:
        raise PayloadError(f"site privacy policy: refusing to send private arrays {private[:5]}")
    if not payload.sends_weights:
        undeclared = sorted(set(array_keys) - set(payload.arrays))
        if undeclared:
            raise PayloadError(f"site privacy policy: this method sends no weights, got arrays {undeclared[:5]}")
    extra_meta = sorted(set(meta_keys) - set(payload.allowed_meta()))
    if extra_meta:
        raise PayloadError(f"site privacy policy: undeclared meta keys {extra_meta}")


def job_method(fl_ctx: FLContext) -> str:
    """The method named by the running job's client config (``executors[0].executor.args.method``)."""
    app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT) or ""
    path = os.path.join(app_root, "config", CLIENT_CONFIG)
    try:
        with open(path) as f:
            config: dict[str, Any] = json.load(f)
        return str(config["executors"][0]["executor"]["args"]["method"])
    except (OSError, KeyError, IndexError, json.JSONDecodeError) as exc:
        raise PayloadError(f"site privacy policy: cannot tell which method this job runs ({path}: {exc})") from exc


def _payload(method: str) -> Payload:
    from medflare.registry import get_method

    return get_method(method).payload
