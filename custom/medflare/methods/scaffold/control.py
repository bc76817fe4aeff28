"""SCAFFOLD's control variates on the wire: one flat float32 vector over the model's shared float arrays, in sorted key
order, so the server (which holds a state dict, not a network) and each site lay it out alike. Entries of float buffers
(BatchNorm's running statistics) are part of the layout but take no gradient: a site leaves them at zero."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from medflare import contracts
from medflare.contracts import ArraySpec, Payload

SERVER_CONTROL = "scaffold_c"  # server -> site with every train task: the server's control variate c
DELTA_CONTROL = "scaffold_delta_c"  # site -> server with every train result: Δc_i = c_i⁺ − c_i
CONTROL_DIM = "controls"  # the vectors' length, sent as a named array dimension (contracts.ARRAY_DIMS)
# |Δc_i| per entry: c_i⁺ is the site's mean corrected gradient over its K steps, and a gradient entry of a classifier
# trained with cross-entropy stays far below this; a larger one is a forged control (the norm bound compares the rest)
MAX_CONTROL = 1e4

PAYLOAD = Payload(
    arrays={DELTA_CONTROL: ArraySpec(shape=(CONTROL_DIM,), dtypes=("float32",), low=-MAX_CONTROL, high=MAX_CONTROL)},
    receives=(SERVER_CONTROL,),
)


def control_keys(state: Mapping[str, object], payload: Payload = PAYLOAD) -> list[str]:
    """The keys a control vector covers: the shared float arrays of ``state`` (numpy or torch), sorted."""
    shared = payload.shared_keys(list(state), contracts.TRAIN_PHASE)
    return sorted(key for key in shared if _is_float(state[key]))


def control_size(state: Mapping[str, object], keys: Sequence[str]) -> int:
    """The number of entries a control vector over ``keys`` of ``state`` holds."""
    return int(sum(int(np.prod(tuple(state[key].shape), dtype=np.int64)) for key in keys))


def _is_float(value: object) -> bool:
    dtype = value.dtype  # type: ignore[attr-defined]  # a torch.Tensor's or a numpy array's
    return bool(dtype.is_floating_point) if hasattr(dtype, "is_floating_point") else np.dtype(dtype).kind == "f"
