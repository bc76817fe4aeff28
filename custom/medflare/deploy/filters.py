"""Site-enforced privacy filters: what a site lets leave it, decided by the site's own ``local/privacy.json``.

The method's code already refuses to send undeclared keys (``Payload.check_outgoing``). These filters repeat
the check *outside* the job, as FLARE task-result filters configured by the hospital, so a pre-installed site
enforces the reviewed declaration even if a job's configuration asks for something else: names, and the same
value checks the server applies (``contracts.check_result_values``: array types, shapes and ranges, typed meta,
the schema of evaluation statistics), so a site's policy never depends on the server's honesty.
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

from medflare import contracts
from medflare.contracts import ContractContext, Payload
from medflare.errors import PayloadError

CLIENT_CONFIG = "config_fed_client.json"
SUBMIT_MODEL = "submit_model"


class PayloadGuard(Filter):
    """Refuses any task result that carries a key the method's Payload does not declare, or a declared key
    whose value breaks the method's contract (a 20 KB string as ``n_samples``, nested extras in an evaluation,
    a probability matrix of 5.0, NaN weights).

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
        args = job_executor_args(fl_ctx)
        payload = _payload(self.method or str(args.get("method", "")))
        check_result_keys(payload, list((dxo.data or {}).keys()), list((dxo.meta or {}).keys()))
        task_name = str(fl_ctx.get_prop(FLContextKey.TASK_NAME) or contracts.TRAIN_PHASE)
        phase = contracts.TRAIN_PHASE if task_name == SUBMIT_MODEL else task_name  # both carry the weights
        task = _task_dxo(fl_ctx)
        check_arrays_were_received(payload, list((dxo.data or {}).keys()), task, phase)
        contracts.check_result_values(payload, dxo.data or {}, dxo.meta or {}, _contract(args, task), phase)
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


def check_arrays_were_received(payload: Payload, array_keys: list[str], task: Any, phase: str) -> None:
    """Weights go back only under the names the server sent: an array that is neither a received weight nor
    declared by the method (``stolen_images``) is refused. Without the task's data (not a DXO) nothing is known
    to compare with, and the value checks still apply."""
    if task is None or phase != contracts.TRAIN_PHASE:
        return
    unknown = sorted(set(array_keys) - set(task.data or {}) - set(payload.arrays_for(phase)))
    if unknown:
        raise PayloadError(f"site privacy policy: the result carries arrays the server never sent and the method "
                           f"does not declare: {unknown[:5]}")


def job_method(fl_ctx: FLContext) -> str:
    """The method named by the running job's client config (``executors[0].executor.args.method``)."""
    return str(job_executor_args(fl_ctx)["method"])


def job_executor_args(fl_ctx: FLContext) -> dict[str, Any]:
    """The medflare executor's args in the running job's client config (method, task, ...)."""
    app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT) or ""
    path = os.path.join(app_root, "config", CLIENT_CONFIG)
    try:
        with open(path) as f:
            config: dict[str, Any] = json.load(f)
        args = config["executors"][0]["executor"]["args"]
        str(args["method"])
        int(args["task"]["num_classes"])
        return dict(args)
    except (OSError, KeyError, IndexError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise PayloadError(f"site privacy policy: cannot tell which method and task this job runs ({path}: "
                           f"{exc!r})") from exc


def _task_dxo(fl_ctx: FLContext) -> Any:
    """The DXO of the task this result answers (FLARE keeps the task's data in the context), or None."""
    task_data = fl_ctx.get_prop(FLContextKey.TASK_DATA)
    if not isinstance(task_data, Shareable):
        return None
    try:
        return from_shareable(task_data)
    except (ValueError, TypeError, KeyError):  # not a DXO
        return None


def _contract(args: dict[str, Any], task: Any) -> ContractContext:
    """The task's K and multi-label flag from the job, and the array dimensions the server's task declared."""
    dims = dict((task.meta or {}).get(contracts.ARRAY_DIMS) or {}) if task is not None else {}
    declared = args["task"]
    return ContractContext(int(declared["num_classes"]), dims=dims, multi_label=bool(declared.get("multi_label", False)))


def _payload(method: str) -> Payload:
    from medflare.registry import get_method

    return get_method(method).payload
