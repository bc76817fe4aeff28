"""What travels in a public-set logit exchange (MDH-FL, FedMD): task names, keys and the one Payload. A round of
the exchange, with M chunks of public rows:

    [public_setup]            round 0 only: each site reports its public set's SHA-256 digest and size
    public_probs -> distill   chunks 1..M-1: probabilities up, each site's own mixed target T_p down, KL steps
    public_probs -> train     last chunk: the same, then E_l local epochs on private data, evaluation

Sites send probabilities and scalars only, never a weight; the server sends each site only its own T_p and the
rows of the public set the next chunk covers.
"""

from __future__ import annotations

import re
from typing import Any

from medflare.contracts import MAX_SAMPLES, ContractContext, MetaValidator, Payload, non_negative_number, probabilities
from medflare.errors import PayloadError

SETUP_PHASE = "public_setup"
PROBS_PHASE = "public_probs"
DISTILL_PHASE = "distill"

PROBS = "probs"  # site -> server: softmax of the site's model on the chunk's public rows (rows x K)
TARGET = "target"  # server -> one site: its mixed target T_p on the same rows (rows x K, rows sum to s_p <= 1)
PUBLIC_ROWS = "public_rows"  # server -> site: int64 [first row, row count] of the chunk (wrapping around the set)

PUBLIC_DIGEST = "public_digest"  # SHA-256 of the site's copy of the public set (pixels and order)
PUBLIC_SIZE = "public_size"  # images in that copy
PRIVATE_LOSS = "private_loss"  # mean private SCE loss of the site's current model (CCR's L_p), first chunk only
KL_LOSS = "kl_loss"  # mean distillation loss of the chunk's KL steps (cross-entropy part of Σ w_i KL(t_i ‖ p))

_SHA256 = re.compile(r"[0-9a-f]{64}")


def sha256_hex(name: str) -> MetaValidator:
    """Validator for a SHA-256 digest as 64 lowercase hex characters (nothing else can ride in it)."""

    def check(value: Any, ctx: ContractContext) -> str:
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            raise PayloadError(f"'{name}' must be a SHA-256 hex digest (64 lowercase hex characters)")
        return value

    return check


def image_count(name: str) -> MetaValidator:
    """Validator for a whole number of images in [1, MAX_SAMPLES]."""

    def check(value: Any, ctx: ContractContext) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SAMPLES:
            raise PayloadError(f"'{name}' must be a whole number of images in [1, {MAX_SAMPLES}], got {value!r}")
        return value

    return check


PAYLOAD = Payload(
    sends_weights=False,
    arrays={PROBS: probabilities(phase=PROBS_PHASE)},  # float16 by default, float32 allowed; never float64
    receives=(TARGET, PUBLIC_ROWS),
    meta={PUBLIC_DIGEST: sha256_hex(PUBLIC_DIGEST), PUBLIC_SIZE: image_count(PUBLIC_SIZE),
          PRIVATE_LOSS: non_negative_number(PRIVATE_LOSS), KL_LOSS: non_negative_number(KL_LOSS)},
)
