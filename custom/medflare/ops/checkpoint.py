"""A round checkpoint: name -> array parameters and JSON state in one ``.npz`` file, written atomically.

No pickle: arrays are stored as arrays and the state as UTF-8 JSON bytes, so loading a checkpoint never runs code.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from medflare import readback
from medflare.errors import DataError
from medflare.ops.background import BackgroundWrite

STATE_KEY = "__state__"
PARAM_PREFIX = "param:"


def save_checkpoint(
    path: str | Path,
    params: Mapping[str, np.ndarray],
    state: Mapping[str, Any],
    json_default: Callable[[Any], Any] | None = None,
    writer: BackgroundWrite | None = None,
) -> None:
    """Write ``params`` and ``state`` to ``path``; a crash mid-write leaves the previous checkpoint intact.

    Args:
        path: the checkpoint file (``.npz``).
        params: name -> array (e.g. the global model); the arrays must not change until the write is done.
        state: JSON-serialisable state (round counter, results, ...); encoded before this returns.
        json_default: ``json.dumps`` fallback for values JSON does not know (e.g. numpy scalars).
        writer: write the arrays in this background writer (after the one in flight) instead of now.
    """
    encoded = np.frombuffer(json.dumps(dict(state), default=json_default).encode(), dtype=np.uint8)
    arrays = {STATE_KEY: encoded, **{PARAM_PREFIX + k: np.asarray(v) for k, v in params.items()}}

    def write() -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)

    if writer is None:
        write()
    else:
        writer.start(write)


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The (params, state) :func:`save_checkpoint` wrote to ``path``, checked before anything uses them.

    Raises:
        DataError: one line naming the file: not an npz of this layout, state that is not a JSON object (or nests
            deeper than ``readback.MAX_DEPTH``), or a parameter holding NaN or infinity.
    """
    name = f"checkpoint {path}"
    try:
        with np.load(path, allow_pickle=False) as npz:
            raw = npz[STATE_KEY].tobytes().decode()
            params = {name[len(PARAM_PREFIX):]: npz[name] for name in npz.files if name.startswith(PARAM_PREFIX)}
        state = json.loads(raw)
    except RecursionError:
        raise DataError(f"{name}: its state nests deeper than {readback.MAX_DEPTH} levels; {readback.CHANGED}") from None
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:  # JSONDecodeError, UnicodeError: ValueError
        raise DataError(f"{name} is not a medflare checkpoint ({exc}); {readback.CHANGED}") from exc
    readback.check(state, readback.OBJECT, name, fix=readback.CHANGED)
    readback.check_finite(params, name)
    return params, state
