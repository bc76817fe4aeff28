"""The wire contract: what may leave a site, declared once per method, and checked on both ends.

A method declares a :class:`Payload`. The site-side executor calls :meth:`Payload.check_outgoing` on every
result before it is sent, so a method that tries to send an undeclared meta key, a private parameter or a
non-finite number fails loudly at the site. The server calls :func:`validate_update` on every incoming result,
so a malformed, tampered or numerically broken update is rejected with a reason instead of poisoning the
global model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from medflare.errors import PayloadError

# Meta keys every method may send. They carry no per-class information.
N_SAMPLES = "n_samples"  # labelled training samples used this round (FedAvg weight)
TRAIN_LOSS = "train_loss"  # mean training loss of this round
TRAIN_SECONDS = "train_seconds"  # wall time of local training
EVAL_VAL = "eval_val"  # EvalStats.to_dict() of the *received* model on the site's validation split
EVAL_TEST = "eval_test"  # same on the site's test split (reported, never used for selection)
EVAL_TEST_BY_ATTRIBUTE = "eval_test_by_attribute"  # {attribute value: EvalStats dict} when images carry one

PRIVACY_SCOPE_PREFIX = "medflare-"  # a job names the scope medflare-<method>; sites bind its result filters


def privacy_scope(method: str) -> str:
    """The FLARE privacy scope a job of ``method`` names in meta.json (see deploy/policies.py)."""
    return PRIVACY_SCOPE_PREFIX + method


# Keys the server writes into each task (server -> site).
ROUND = "round"
TOTAL_ROUNDS = "total_rounds"
STAGE = "stage"

MetaValidator = Callable[[Any, "ContractContext"], Any]


@dataclass(frozen=True)
class ContractContext:
    """What a validator may need to know about the task (never about a site's data)."""

    num_classes: int


def _finite_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise PayloadError(f"'{name}' must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise PayloadError(f"'{name}' must be finite, got {number}")
    return number


def non_negative_number(name: str) -> MetaValidator:
    """Validator for a finite scalar >= 0."""

    def check(value: Any, ctx: ContractContext) -> float:
        number = _finite_number(value, name)
        if number < 0:
            raise PayloadError(f"'{name}' must be >= 0, got {number}")
        return number

    return check


def positive_number(name: str, upper: float | None = None) -> MetaValidator:
    """Validator for a finite scalar > 0 (and <= ``upper`` when given)."""

    def check(value: Any, ctx: ContractContext) -> float:
        number = _finite_number(value, name)
        if number <= 0 or (upper is not None and number > upper):
            bound = f" and <= {upper}" if upper is not None else ""
            raise PayloadError(f"'{name}' must be > 0{bound}, got {number}")
        return number

    return check


def class_vector(name: str) -> MetaValidator:
    """Validator for a length-K vector of finite, non-negative numbers (e.g. per-class counts)."""

    def check(value: Any, ctx: ContractContext) -> list[float]:
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"'{name}' must be a numeric vector: {exc}") from exc
        if array.shape != (ctx.num_classes,):
            raise PayloadError(f"'{name}' must have shape ({ctx.num_classes},), got {array.shape}")
        if not np.all(np.isfinite(array)) or np.any(array < 0):
            raise PayloadError(f"'{name}' must be finite and >= 0, got {array.tolist()}")
        return array.tolist()

    return check


def eval_stats_dict(name: str) -> MetaValidator:
    """Validator for an EvalStats dictionary (summable confusion and score histograms)."""

    def check(value: Any, ctx: ContractContext) -> Any:
        from medflare.metrics import EvalStats  # local: metrics imports nothing from here

        try:
            EvalStats.from_dict(value, num_classes=ctx.num_classes)
        except PayloadError as exc:
            raise PayloadError(f"'{name}': {exc}") from exc
        return value

    return check


def eval_stats_by_group(name: str) -> MetaValidator:
    """Validator for {group name: EvalStats dictionary} (e.g. per skin-tone attribute)."""
    check_one = eval_stats_dict(name)

    def check(value: Any, ctx: ContractContext) -> Any:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise PayloadError(f"'{name}' must map group names to evaluation statistics")
        return {group: check_one(stats, ctx) for group, stats in value.items()}

    return check


COMMON_META: dict[str, MetaValidator] = {
    N_SAMPLES: non_negative_number(N_SAMPLES),
    TRAIN_LOSS: non_negative_number(TRAIN_LOSS),
    TRAIN_SECONDS: non_negative_number(TRAIN_SECONDS),
    EVAL_VAL: eval_stats_dict(EVAL_VAL),
    EVAL_TEST: eval_stats_dict(EVAL_TEST),
    EVAL_TEST_BY_ATTRIBUTE: eval_stats_by_group(EVAL_TEST_BY_ATTRIBUTE),
}


@dataclass(frozen=True)
class Payload:
    """Everything a method's site sends to the server, declared in one place.

    Attributes:
        sends_weights: whether model parameters leave the site at all (False for logit-exchange methods).
        private_keys: regex of state-dict keys that never leave the site (e.g. a personalized head).
        arrays: names of extra arrays sent instead of / besides weights (e.g. public-set probabilities).
        meta: method-specific meta keys and their validators, on top of :data:`COMMON_META`.
    """

    sends_weights: bool = True
    private_keys: str | None = None
    arrays: tuple[str, ...] = ()
    meta: Mapping[str, MetaValidator] = field(default_factory=dict)

    def is_private(self, key: str) -> bool:
        """True when ``key`` must stay at the site."""
        return bool(self.private_keys) and re.search(self.private_keys, key) is not None

    def allowed_meta(self) -> dict[str, MetaValidator]:
        """All meta keys this method may send, with their validators."""
        return {**COMMON_META, **dict(self.meta)}

    def shared_keys(self, model_keys: list[str]) -> list[str]:
        """The model's state-dict keys that may leave the site."""
        if not self.sends_weights:
            return []
        return [k for k in model_keys if not self.is_private(k)]

    def check_outgoing(
        self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], model_keys: list[str], ctx: ContractContext
    ) -> None:
        """Raise PayloadError if a site result carries anything the method did not declare.

        Called at the site on every result, just before it is handed to FLARE.
        """
        allowed_arrays = set(self.shared_keys(model_keys)) | set(self.arrays)
        leaked = sorted(set(arrays) - allowed_arrays)
        if leaked:
            raise PayloadError(f"refusing to send undeclared or private arrays: {leaked[:5]}")
        _check_meta(meta, self.allowed_meta(), ctx)
        _check_finite_arrays(arrays)


def _check_meta(meta: Mapping[str, Any], allowed: Mapping[str, MetaValidator], ctx: ContractContext) -> dict:
    undeclared = sorted(set(meta) - set(allowed))
    if undeclared:
        raise PayloadError(f"undeclared meta keys {undeclared}; declared: {sorted(allowed)}")
    return {key: allowed[key](value, ctx) for key, value in meta.items()}


def _check_finite_arrays(arrays: Mapping[str, np.ndarray]) -> None:
    for key, value in arrays.items():
        array = np.asarray(value)
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise PayloadError(f"array '{key}' contains NaN or Inf")


def validate_update(
    arrays: Mapping[str, Any],
    meta: Mapping[str, Any],
    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    payload: Payload,
    ctx: ContractContext,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Server-side check of one site's update; returns the arrays as numpy and the validated meta.

    Args:
        arrays: what the site sent (weights and/or declared arrays).
        meta: the site's meta.
        expected: key -> (shape, dtype) the server expects: shared model keys plus declared arrays.
        payload: the method's declaration.
        ctx: task facts (class count).

    Raises:
        PayloadError: naming the first problem (missing/extra key, shape, dtype, non-finite value, bad meta).
    """
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing:
        raise PayloadError(f"missing keys {missing[:5]} ({len(missing)} in all)")
    if extra:
        raise PayloadError(f"unexpected keys {extra[:5]} ({len(extra)} in all)")
    clean: dict[str, np.ndarray] = {}
    for key, (shape, dtype) in expected.items():
        value = np.asarray(arrays[key])
        if tuple(value.shape) != tuple(shape):
            raise PayloadError(f"'{key}' has shape {tuple(value.shape)}, expected {tuple(shape)}")
        if value.dtype.kind != np.dtype(dtype).kind:
            raise PayloadError(f"'{key}' has dtype {value.dtype}, expected {np.dtype(dtype)}")
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise PayloadError(f"'{key}' contains NaN or Inf")
        clean[key] = value
    return clean, _check_meta(meta, payload.allowed_meta(), ctx)
