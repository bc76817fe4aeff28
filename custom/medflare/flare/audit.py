"""What really crossed the wire at a site: a FLARE filter that records every task and result it sees.

As a site's last task-data and task-result filter (``export_job(..., audit=True)``) it writes one JSON line per
message into the site's job folder: array names with dtype and shape, meta keys and bytes, never values. Tests
compare these with each method's declared payload, so a declaration that drifts from what is sent fails.
"""

from __future__ import annotations

import json
import os

import numpy as np
from nvflare.apis.dxo import from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

AUDIT_FILE = "medflare_payload_audit.jsonl"
DIRECTIONS = ("task", "result")


class PayloadRecorder(Filter):
    """Records the structure of every message it filters, which passes unchanged; ``direction``: "task" (server ->
    site, as a task-data filter) or "result" (site -> server)."""

    def __init__(self, direction: str = "result") -> None:
        super().__init__()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got '{direction}'")
        self.direction = direction

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        record: dict = {"direction": self.direction, "task": fl_ctx.get_prop(FLContextKey.TASK_NAME, "")}
        if shareable.get_return_code() not in (None, ReturnCode.OK):
            record["return_code"] = str(shareable.get_return_code())
        else:
            dxo = from_shareable(shareable)
            arrays = dxo.data or {}
            record["arrays"] = {k: [np.asarray(v).dtype.name, list(np.shape(v))] for k, v in arrays.items()}
            record["meta"] = sorted(dxo.meta or {})
            record["header"] = {k: v for k, v in (dxo.meta or {}).items() if k in ("round", "stage")}
            record["bytes"] = int(sum(getattr(v, "nbytes", 0) for v in arrays.values()))
        path = os.path.join(fl_ctx.get_prop(FLContextKey.APP_ROOT) or ".", AUDIT_FILE)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return shareable
