"""The wire contract: what may leave a site, declared once per method (:class:`Payload`), checked on both ends.

The site checks every result before sending (:meth:`Payload.check_outgoing`: no undeclared key, private
parameter, non-finite or out-of-range value); the server rejects a malformed, oversized or tampered one with a
reason (:func:`validate_update`). A site's privacy filter applies :func:`check_result_values`, the part that needs
no knowledge of the server's model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from medflare.errors import PayloadError
from medflare.metrics.eval_stats import MAX_COUNT

# Meta keys every method may send. They carry no per-class information.
N_SAMPLES = "n_samples"  # labelled training samples used this round (FedAvg weight)
TRAIN_LOSS = "train_loss"  # mean training loss of this round
TRAIN_SECONDS = "train_seconds"  # wall time of local training
EVAL_VAL = "eval_val"  # EvalStats.to_dict() of the *received* model on the site's validation split
EVAL_TEST = "eval_test"  # same on the site's test split (reported, never used for selection)
EVAL_TEST_BY_ATTRIBUTE = "eval_test_by_attribute"  # {attribute value: EvalStats dict} when images carry one
EVAL_EXTRA = "eval_extra"  # {evaluation name: {"val"|"test": EvalStats dict}}: method-declared evaluations
FILTER_HISTORY = "filter_history"  # added by FLARE's DXO filters: the names of the filters a result went through
# The only words filter_history may carry out of a hospital: the class names FLARE's DXOFilter writes there, of
# FLARE's own result filters (a site's own filter class, or a forged entry, could name a path or a patient)
FILTER_NAMES = frozenset({"PercentilePrivacy", "SVTPrivacy", "ExcludeVars", "DXOBlocker", "StatisticsPrivacyFilter",
                          "ConvertWeights", "HEModelEncryptor", "HEModelDecryptor", "ModelQuantizer", "ModelDequantizer"})
DP_EPSILON = "dp_epsilon"  # DP-SGD only: ε the site has spent in this job so far, at the job's δ (medflare.dp_sgd)
DECLINED_HEADER = "medflare_declined"  # header of an error reply: why the site declined, a key of DECLINE_REASONS
# The only words a site's decline may carry out of the hospital (free text could carry a path or a patient's name);
# the server records the sentence, the site's own log keeps the details.
DECLINE_REASONS = {
    "policy": "its site policy declines the job (methods or required defences)",
    "dp_policy": "its DP-SGD policy declines the job's dp_sgd",
    "dp_budget": "its DP-SGD budget is spent; it stops contributing",
    "implausible_model": "the decrypted global model is implausible",
    "server_plan": "the server runs another plan than this site's copy, or does not prove its plan",
    "server_defences": "the server's declared defences are weaker than this site's policy requires",
    "platform": "this site's or the server's FLARE is below the first release without the known advisories",
    "code": "the job's code is not among the code this site approves",
}
# header a site's task filter puts on a task it refuses to train on (e.g. an implausible decrypted model): the
# executor declines the task with that reason instead of training
REFUSED_TASK_HEADER = "medflare_refused_task"

PRIVACY_SCOPE_PREFIX = "medflare-"  # a job names the scope medflare-<method>; sites bind its result filters
TRAIN_PHASE = "train"  # the phase whose results are aggregated into the next global model
MAX_SAMPLES = MAX_COUNT  # no site trains on more images than this; larger n_samples is a forged weight
# Integer buffers (BatchNorm's num_batches_tracked) are counters: whole, >= 0, and below 2**53, where float64 still
# holds every integer exactly, so averaging them can neither lose a count nor wrap around int64.
MAX_INTEGER_BUFFER = 2**53


def privacy_scope(method: str) -> str:
    """The FLARE privacy scope a job of ``method`` names in meta.json (see console/deploy/policies.py)."""
    return PRIVACY_SCOPE_PREFIX + method


# Keys the server writes into each task (server -> site).
ROUND = "round"
TOTAL_ROUNDS = "total_rounds"
STAGE = "stage"
STAGE_ROUND = "stage_round"
STAGE_ROUNDS = "stage_rounds"
SCORED = "scored"  # False in stages without a classifier (pre-training): sites send no evaluation
ARRAY_DIMS = "array_dims"  # named dimensions of this task's declared arrays, e.g. {"rows": 512}
TRANSFER_DTYPE = "transfer_dtype"  # "float32" (default) or "float16": how float weights travel
TRANSFER_KIND = "transfer_kind"  # "weights" (default) or "diff": updates as differences (for DP filters)
# The server proves its plan (medflare.plan_proof): every task carries its plan's fingerprint and the defences it runs
# with; every result carries the site's fingerprint back (a Shareable header), so each side compares with its own copy
SERVER_PLAN = "server_plan"  # the server's plan fingerprint (RunPlan.digest)
SERVER_DEFENCES = "server_defences"  # {"robust": RobustConfig fields, "min_clients": int, "secure_aggregation": str}
SERVER_NVFLARE = "server_nvflare"  # the FLARE release the server runs (medflare.advisories judges it at each site)
SITE_PLAN_HEADER = "medflare_site_plan"  # header of a site's result: the fingerprint of the plan the site runs
# secure_aggregation=he: {name: [shape, dtype]} of the arrays a task or result carries as CKKS ciphertexts
ENCRYPTED_ARRAYS = "encrypted_arrays"

MetaValidator = Callable[[Any, "ContractContext"], Any]


@dataclass(frozen=True)
class ContractContext:
    """What a validator may need to know about the task (never about a site's data): K, the task's named array
    dimensions (:class:`ArraySpec`), whether it is multi-label, and the most local epochs a site of the job trains
    (what a value summed over epochs, such as Fed-MAS's Eq. 3 rescue factor, can reach)."""

    num_classes: int
    dims: Mapping[str, int] = field(default_factory=dict)
    multi_label: bool = False
    local_epochs: int = 1

    def resolve(self, dim: int | str) -> int | None:
        """A declared dimension as a number: ints as they are, "num_classes" = K, other names from ``dims``."""
        if isinstance(dim, int):
            return dim
        if dim == "num_classes":
            return self.num_classes
        value = self.dims.get(dim)
        return None if value is None else int(value)


# ----- meta validators ----------------------------------------------------------------------------------------
def _finite_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise PayloadError(f"'{name}' must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise PayloadError(f"'{name}' must be finite, got {number}")
    return number


def non_negative_number(name: str, upper: float | None = None) -> MetaValidator:
    """Validator for a finite scalar >= 0 (and <= ``upper`` when given)."""

    def check(value: Any, ctx: ContractContext) -> float:
        number = _finite_number(value, name)
        if number < 0 or (upper is not None and number > upper):
            bound = f" and <= {upper:g}" if upper is not None else ""
            raise PayloadError(f"'{name}' must be >= 0{bound}, got {number}")
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
        if isinstance(value, (str, bytes)):
            raise PayloadError(f"'{name}' must be a numeric vector, got a string")
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


def _class_vector_of(name: str, allowed: Callable[[float], bool], rule: str) -> MetaValidator:
    """:func:`class_vector` whose every entry must also be ``allowed`` (``rule`` says what is)."""
    check_vector = class_vector(name)

    def check(value: Any, ctx: ContractContext) -> list[float]:
        values = check_vector(value, ctx)
        if not all(allowed(v) for v in values):
            raise PayloadError(f"'{name}' must hold {rule}, got {values[:8]}")
        return values

    return check


def class_counts(name: str, upper: float = MAX_SAMPLES) -> MetaValidator:
    """Validator for a length-K vector of whole counts <= ``upper`` (e.g. FedLSM's q: a fractional or huge count
    is a forged aggregation weight)."""
    return _class_vector_of(name, lambda v: v == round(v) and v <= upper, f"whole counts <= {upper:g}")


def class_mask(name: str) -> MetaValidator:
    """Validator for a length-K 0/1 vector (e.g. the classes a site annotates)."""
    return _class_vector_of(name, lambda v: v in (0.0, 1.0), "only 0 and 1")


def declared_words(name: str, words: frozenset[str], max_items: int = 16) -> MetaValidator:
    """Validator for a short list of words out of ``words`` (e.g. FLARE's ``filter_history``: :data:`FILTER_NAMES`);
    the refusal gives the positions of other entries, never their text (the site's log has it)."""

    def check(value: Any, ctx: ContractContext) -> list[str]:
        if not isinstance(value, list) or len(value) > max_items:
            raise PayloadError(f"'{name}' must be a list of at most {max_items} names")
        other = [index for index, word in enumerate(value) if not isinstance(word, str) or word not in words]
        if other:
            raise PayloadError(f"'{name}' may name only {', '.join(sorted(words))}; entries {other[:5]} are not (their "
                               "text is not repeated here: free text could name a path or a patient)")
        return list(value)

    return check


def eval_stats_dict(name: str) -> MetaValidator:
    """Validator for an EvalStats dictionary; returns its canonical form, so nothing else rides along."""

    def check(value: Any, ctx: ContractContext) -> Any:
        from medflare.metrics import stats_from_dict  # local: metrics imports nothing from here

        try:
            canonical = stats_from_dict(value, ctx.num_classes, ctx.multi_label).to_dict()
        except PayloadError as exc:
            raise PayloadError(f"'{name}': {exc}") from exc
        extra = sorted(set(value) - set(canonical)) if isinstance(value, dict) else []
        if extra:
            raise PayloadError(f"'{name}' carries undeclared entries {extra[:5]}")
        return canonical

    return check


def eval_stats_by_group(name: str, max_groups: int = 64) -> MetaValidator:
    """Validator for {group name: EvalStats dictionary} (e.g. per skin-tone attribute, or per split)."""
    check_one = eval_stats_dict(name)

    def check(value: Any, ctx: ContractContext) -> Any:
        if not isinstance(value, dict) or not all(isinstance(k, str) and len(k) <= 64 for k in value):
            raise PayloadError(f"'{name}' must map short group names to evaluation statistics")
        if len(value) > max_groups:
            raise PayloadError(f"'{name}' has {len(value)} groups, at most {max_groups} are allowed")
        return {group: check_one(stats, ctx) for group, stats in value.items()}

    return check


def eval_extra(name: str) -> MetaValidator:
    """Validator for {evaluation name: {"val"|"test": EvalStats dict}} (method-declared evaluations)."""
    check_splits = eval_stats_by_group(name, max_groups=2)

    def check(value: Any, ctx: ContractContext) -> Any:
        if not isinstance(value, dict) or len(value) > 8:
            raise PayloadError(f"'{name}' must map at most 8 evaluation names to their statistics")
        checked = {}
        for evaluation, splits in value.items():
            if not isinstance(splits, dict) or not set(splits) <= {"val", "test"}:
                raise PayloadError(f"'{name}.{evaluation}' must map 'val'/'test' to statistics")
            checked[str(evaluation)] = check_splits(splits, ctx)
        return checked

    return check


COMMON_META: dict[str, MetaValidator] = {
    N_SAMPLES: non_negative_number(N_SAMPLES, upper=MAX_SAMPLES),
    TRAIN_LOSS: non_negative_number(TRAIN_LOSS),
    TRAIN_SECONDS: non_negative_number(TRAIN_SECONDS),
    EVAL_VAL: eval_stats_dict(EVAL_VAL),
    EVAL_TEST: eval_stats_dict(EVAL_TEST),
    EVAL_TEST_BY_ATTRIBUTE: eval_stats_by_group(EVAL_TEST_BY_ATTRIBUTE),
    EVAL_EXTRA: eval_extra(EVAL_EXTRA),
    FILTER_HISTORY: declared_words(FILTER_HISTORY, FILTER_NAMES),
    DP_EPSILON: non_negative_number(DP_EPSILON),
}


# ----- arrays ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArraySpec:
    """Shape, dtype and value rules of one named non-parameter array (e.g. public-set probabilities). ``shape``
    holds ints, "num_classes" or names the server fills in per task (``ARRAY_DIMS``); the first of ``dtypes`` is what
    a site sends; ``low``/``high`` are inclusive; each row (last axis) sums to ``row_sum`` within ``row_sum_tol``;
    ``phase`` is the task whose result carries it (site -> server arrays only)."""

    shape: tuple[int | str, ...]
    dtypes: tuple[str, ...] = ("float32",)
    low: float | None = None
    high: float | None = None
    row_sum: float | None = None
    row_sum_tol: float = 1e-2
    integral: bool = False
    phase: str = TRAIN_PHASE

    def resolved_shape(self, ctx: ContractContext) -> tuple[int | None, ...]:
        """The shape with every known dimension filled in (None where the task did not say)."""
        return tuple(ctx.resolve(d) for d in self.shape)

    def check(self, name: str, value: Any, ctx: ContractContext) -> np.ndarray:
        """Return ``value`` as an array or raise PayloadError naming the first broken rule."""
        array = _numeric_array(name, value)
        shape = self.resolved_shape(ctx)
        if len(array.shape) != len(shape) or any(s is not None and s != a for s, a in zip(shape, array.shape)):
            raise PayloadError(f"'{name}' has shape {tuple(array.shape)}, expected {_shape_text(shape)}")
        if array.dtype.name not in self.dtypes:
            raise PayloadError(f"'{name}' has dtype {array.dtype}, expected one of {list(self.dtypes)}")
        _check_finite(name, array)
        values = array.astype(np.float64)
        if self.low is not None and values.size and values.min() < self.low:
            raise PayloadError(f"'{name}' has values below {self.low}: min {values.min():.6g}")
        if self.high is not None and values.size and values.max() > self.high:
            raise PayloadError(f"'{name}' has values above {self.high}: max {values.max():.6g}")
        if self.integral and not np.all(values == np.round(values)):
            raise PayloadError(f"'{name}' must hold whole numbers (counts)")
        if self.row_sum is not None and values.size:
            worst = float(np.abs(values.sum(axis=-1) - self.row_sum).max())
            if worst > self.row_sum_tol:
                raise PayloadError(f"rows of '{name}' must sum to {self.row_sum} (±{self.row_sum_tol}), off by {worst:.4g}")
        return array

    def nbytes(self, ctx: ContractContext) -> int:
        """Largest valid size in bytes (unknown dimensions count as 1)."""
        count = int(np.prod([d or 1 for d in self.resolved_shape(ctx)], dtype=np.int64))
        return count * max(np.dtype(d).itemsize for d in self.dtypes)


def probabilities(rows: str = "rows", dtypes: tuple[str, ...] = ("float16", "float32"), phase: str = TRAIN_PHASE) -> ArraySpec:
    """A rows × K matrix of class probabilities: values in [0, 1], rows summing to 1."""
    return ArraySpec(shape=(rows, "num_classes"), dtypes=dtypes, low=0.0, high=1.0, row_sum=1.0, phase=phase)


def counts(shape: tuple[int | str, ...] = ("num_classes",), phase: str = TRAIN_PHASE) -> ArraySpec:
    """Whole-number counts in [0, MAX_SAMPLES] (e.g. per-class positives and negatives of a site's images)."""
    return ArraySpec(shape=shape, dtypes=("int64", "float64", "float32"), low=0.0, high=MAX_SAMPLES, integral=True,
                     phase=phase)


@dataclass(frozen=True)
class Expected:
    """What the server expects under one key of one site result: exact shape, allowed dtypes, value rules."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    rules: ArraySpec | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * max(np.dtype(d).itemsize for d in self.dtypes)

    def check(self, name: str, value: Any, ctx: ContractContext) -> np.ndarray:
        if self.rules is not None:
            return self.rules.check(name, value, ctx)
        array = _numeric_array(name, value)
        if tuple(array.shape) != tuple(self.shape):
            raise PayloadError(f"'{name}' has shape {tuple(array.shape)}, expected {tuple(self.shape)}")
        if array.dtype.name not in self.dtypes:
            raise PayloadError(f"'{name}' has dtype {array.dtype}, expected {' or '.join(self.dtypes)}")
        _check_finite(name, array)
        return array


def weight_expectations(
    global_params: Mapping[str, np.ndarray], keys: list[str], transfer_dtype: str = "float32", kind: str = "weights"
) -> dict[str, Expected]:
    """key -> Expected for model weights: the global model's exact shape and dtype (float16 for float keys
    when weights travel in half precision; float keys only when updates travel as differences). Integer buffers
    must be whole counters in [0, MAX_INTEGER_BUFFER]."""
    expected = {}
    for key in keys:
        value = np.asarray(global_params[key])
        if kind == "diff" and value.dtype.kind != "f":
            continue  # integer buffers stay at the site when differences travel
        dtypes = (transfer_dtype if value.dtype.kind == "f" else value.dtype.name,)
        rules = (ArraySpec(tuple(value.shape), dtypes, low=0.0, high=MAX_INTEGER_BUFFER, integral=True)
                 if value.dtype.kind in "iu" else None)
        expected[key] = Expected(tuple(value.shape), dtypes, rules)
    return expected


def check_frozen_unchanged(
    arrays: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray], payload: Payload,
    transfer_dtype: str = "float32", kind: str = "weights",
) -> None:
    """Raise PayloadError when a frozen part (``Payload.frozen_keys``) comes back other than the server sent it
    (its values in the transfer dtype, or zero differences when differences travel)."""
    for key, value in arrays.items():
        if not payload.is_frozen(key) or key not in global_params:
            continue
        sent = np.asarray(global_params[key])
        expected = (np.zeros(sent.shape) if kind == "diff"
                    else sent.astype(transfer_dtype) if sent.dtype.kind == "f" else sent)
        change = np.abs(np.asarray(value, np.float64) - np.asarray(expected, np.float64))
        if change.size and not np.all(change == 0):
            raise PayloadError(f"'{key}' is frozen by the method but came back changed (max |change| "
                               f"{float(change.max()):.4g}); the server never averages a frozen part")


def array_expectations(specs: Mapping[str, ArraySpec], ctx: ContractContext) -> dict[str, Expected]:
    """key -> Expected for declared arrays; unresolved dimensions are an error of the server rule."""
    expected = {}
    for name, spec in specs.items():
        shape = spec.resolved_shape(ctx)
        if any(d is None for d in shape):
            raise PayloadError(f"the server rule did not set the dimensions {spec.shape} of '{name}'")
        expected[name] = Expected(tuple(int(d) for d in shape), spec.dtypes, spec)
    return expected


# ----- the declaration -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Payload:
    """Everything a method's site sends to the server, and every non-model array it accepts, declared once.

    Attributes:
        sends_weights: whether model parameters leave the site at all (False for logit-exchange methods).
        private_keys: regex of state-dict keys that never leave the site (e.g. a personalized head).
        stage_excluded_keys: stage -> regex of keys that do not travel in that stage (a pre-training decoder).
        arrays: extra named arrays a site sends; receives: those the server may send (a distillation target).
        meta: method-specific meta keys and their validators, on top of :data:`COMMON_META`.
        frozen_keys: regex of shared keys the site trains under but never changes (FedBABU's random head).
    """

    sends_weights: bool = True
    private_keys: str | None = None
    stage_excluded_keys: Mapping[str, str] = field(default_factory=dict)
    arrays: Mapping[str, ArraySpec] = field(default_factory=dict)
    receives: tuple[str, ...] = ()
    meta: Mapping[str, MetaValidator] = field(default_factory=dict)
    frozen_keys: str | None = None

    def is_private(self, key: str) -> bool:
        """True when ``key`` must stay at the site."""
        return bool(self.private_keys) and re.search(self.private_keys, key) is not None

    def is_frozen(self, key: str) -> bool:
        """True when ``key`` travels but must come back as the server sent it."""
        return bool(self.frozen_keys) and re.search(self.frozen_keys, key) is not None

    def allowed_meta(self) -> dict[str, MetaValidator]:
        """All meta keys this method may send, with their validators."""
        return {**COMMON_META, **dict(self.meta)}

    def shared_keys(self, model_keys: list[str], stage: str = TRAIN_PHASE) -> list[str]:
        """The model's state-dict keys that leave the site (and are broadcast) in ``stage``."""
        if not self.sends_weights:
            return []
        excluded = self.stage_excluded_keys.get(stage)
        return [k for k in model_keys if not self.is_private(k) and not (excluded and re.search(excluded, k))]

    def arrays_for(self, phase: str) -> dict[str, ArraySpec]:
        """Declared arrays a result of ``phase`` carries."""
        return {name: spec for name, spec in self.arrays.items() if spec.phase == phase}

    def check_outgoing(self, arrays: Mapping[str, Any], meta: Mapping[str, Any], model_keys: list[str],
                       ctx: ContractContext, phase: str = TRAIN_PHASE, stage: str = TRAIN_PHASE) -> None:
        """At the site, before FLARE gets a result: PayloadError if it carries anything undeclared or a bad value."""
        weights = set(self.shared_keys(model_keys, stage)) if phase == TRAIN_PHASE else set()
        declared = self.arrays_for(phase)
        leaked = sorted(set(arrays) - weights - set(declared))
        if leaked:
            raise PayloadError(f"refusing to send undeclared or private arrays: {leaked[:5]}")
        missing = sorted(set(declared) - set(arrays))
        if missing:
            raise PayloadError(f"a '{phase}' result must carry the declared arrays {missing}")
        check_result_values(self, arrays, meta, ctx, phase)


def check_result_values(
    payload: Payload, arrays: Mapping[str, Any], meta: Mapping[str, Any], ctx: ContractContext, phase: str
) -> dict[str, Any]:
    """The checks a site can make without the server's model (privacy, array rules, meta); returns the validated
    meta. Shared by the site runtime and its privacy filter, so a site's policy never trusts the server."""
    private = sorted(k for k in arrays if payload.is_private(k))
    if private:
        raise PayloadError(f"refusing to send private arrays {private[:5]}")
    declared = payload.arrays_for(phase)
    if not payload.sends_weights or phase != TRAIN_PHASE:
        undeclared = sorted(set(arrays) - set(declared))
        if undeclared:
            raise PayloadError(f"a '{phase}' result of this method carries no weights, got arrays {undeclared[:5]}")
    for key, value in arrays.items():
        if key in declared:
            declared[key].check(key, value, ctx)
        else:
            _check_finite(key, _numeric_array(key, value))
    return _check_meta(meta, payload.allowed_meta(), ctx)


def _numeric_array(name: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiub":
        kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
        raise PayloadError(f"'{name}' must be a numeric array, got {kind}")
    return value


def _check_finite(name: str, array: np.ndarray) -> None:
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise PayloadError(f"'{name}' contains NaN or Inf")


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _check_meta(meta: Mapping[str, Any], allowed: Mapping[str, MetaValidator], ctx: ContractContext) -> dict:
    undeclared = sorted(set(meta) - set(allowed))
    if undeclared:
        raise PayloadError(f"undeclared meta keys {undeclared[:5]}; declared: {sorted(allowed)}")
    return {key: allowed[key](value, ctx) for key, value in meta.items()}


def result_nbytes(arrays: Mapping[str, Any]) -> int:
    """Bytes of a result's arrays, read from their headers (nothing is copied)."""
    return int(sum(getattr(value, "nbytes", 0) for value in arrays.values()))


def validate_update(
    arrays: Mapping[str, Any], meta: Mapping[str, Any], expected: Mapping[str, Expected], payload: Payload,
    ctx: ContractContext, size_factor: float = 1.5,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Server-side check of one site's result against ``expected`` (:func:`weight_expectations`,
    :func:`array_expectations`); returns the arrays and the canonical meta. A result over ``size_factor`` times
    the declared size is refused before anything else. PayloadError names the first problem (size, missing/extra
    key, shape, dtype, value rule, bad meta)."""
    declared_bytes, sent_bytes = sum(e.nbytes for e in expected.values()), result_nbytes(arrays)
    if sent_bytes > size_factor * declared_bytes + 1024:
        raise PayloadError(f"result is {sent_bytes} bytes, the task declares at most {declared_bytes}")
    missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    if missing:
        raise PayloadError(f"missing keys {missing[:5]} ({len(missing)} in all)")
    if extra:
        raise PayloadError(f"unexpected keys {extra[:5]} ({len(extra)} in all)")
    clean = {key: rule.check(key, arrays[key], ctx) for key, rule in expected.items()}
    return clean, _check_meta(meta, payload.allowed_meta(), ctx)
