"""How model weights travel: their dtype on the wire, and whether as weights or as differences.

The server sends the global model's float weights in the job's download dtype (float32, or float16 for half the
bytes; :func:`encode_download`), and a site loads them into its model's own dtype. A site sends its float weights in
the job's transfer dtype (float32, or float16 for half the bytes). When the
job sends updates as differences (``kind="diff"``, what FLARE's differential-privacy filters expect), a site
sends θ_local − θ_received for the float keys only: integer buffers (BatchNorm's ``num_batches_tracked``) stay
home, so a privacy filter never sees them and the server keeps its own value. The server turns what arrived
back into absolute weights before any aggregation rule sees them.
"""

from __future__ import annotations

from typing import Container, Mapping

import numpy as np

from medflare.errors import PayloadError

KINDS = ("weights", "diff")
DTYPES = ("float32", "float16")


def is_float(array: np.ndarray) -> bool:
    """Whether ``array`` holds floating-point values (the weights a wire dtype applies to)."""
    return np.asarray(array).dtype.kind == "f"


def encode_weights(
    weights: Mapping[str, np.ndarray], received: Mapping[str, np.ndarray], dtype: str, kind: str
) -> dict[str, np.ndarray]:
    """The site's weights as they go on the wire (non-float arrays are dropped when sending differences)."""
    wire_dtype = np.dtype(dtype)
    if kind == "weights":
        return {k: v.astype(wire_dtype, copy=False) if is_float(v) else v for k, v in weights.items()}  # no 2nd copy
    missing = sorted(k for k, v in weights.items() if is_float(v) and k not in received)
    if missing:
        raise PayloadError(f"cannot send differences for {missing[:5]}: the server did not send them this round")
    return {
        k: (np.asarray(v, np.float64) - np.asarray(received[k], np.float64)).astype(wire_dtype)
        for k, v in weights.items()
        if is_float(v)
    }


def encode_download(
    arrays: Mapping[str, np.ndarray], model_keys: Container[str], dtype: str
) -> dict[str, np.ndarray]:
    """What the server sends, as it goes on the wire: the model's float weights (``model_keys``) narrowed to
    ``dtype``, every other array as it is (integer buffers such as BatchNorm's counters, and a method's own arrays,
    whose dtype its contract fixes). A weight holding a value ``dtype`` cannot (|x| > 65504 in float16) keeps its
    own dtype, so a site never receives an overflowed infinity."""
    wire_dtype = np.dtype(dtype)
    return {k: v.astype(wire_dtype) if k in model_keys and _narrows(v, wire_dtype) else v for k, v in arrays.items()}


def _narrows(array: np.ndarray, dtype: np.dtype) -> bool:
    """Whether ``array`` is a wider float array whose every value ``dtype`` holds without overflow."""
    array = np.asarray(array)
    if not is_float(array) or array.dtype.itemsize <= dtype.itemsize:
        return False
    return not array.size or bool(np.max(np.abs(array)) <= np.finfo(dtype).max)  # NaN compares False: kept


def decode_weights(
    arrays: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray], kind: str
) -> dict[str, np.ndarray]:
    """Absolute weights from a validated result: differences are added to the global model in float64 and stored
    in the global model's dtype (no float64 copy of a site's model is kept)."""
    if kind == "weights":
        return dict(arrays)
    absolute = {}
    for key, value in arrays.items():
        reference = np.asarray(global_params[key]) if key in global_params else None
        if reference is None:
            absolute[key] = value
        else:
            total = reference.astype(np.float64) + np.asarray(value, np.float64)
            absolute[key] = total.astype(reference.dtype)
    return absolute
