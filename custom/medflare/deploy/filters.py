"""Site-enforced privacy filters: what a site lets leave it, decided by the site's own ``local/privacy.json``.

The method's code already refuses undeclared keys (``Payload.check_outgoing``); these FLARE filters, configured by
the hospital, repeat the check *outside* the job, so a pre-installed site enforces the reviewed declaration whatever
a job's configuration asks: names, every array's shape and dtype against what the server sent or the method
declares, and the server's own value checks (``contracts.check_result_values``), so a site's policy never depends
on the server's honesty.

FLARE 2.9's client runner clears ``FLContextKey.TASK_DATA`` before the task result filters run, so the guard is
bound on both sides: as a task data filter it records the names, shapes and dtypes (never the values) of each task
it lets in, per job, site and task name; as a task result filter it compares the result with that record. Without
a record it fails closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import numpy as np
from nvflare.apis.dxo import from_shareable
from nvflare.apis.filter import Filter, FilterChainType, FilterContextKey, FilterSource
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare import contracts
from medflare.contracts import ContractContext, Expected, Payload
from medflare.errors import MedflareError, PayloadError
from medflare.ops import wire
from medflare.ops.he_aggregate import declared_encrypted, stand_in
from medflare.plan import RunPlan

SUBMIT_MODEL = "submit_model"
DEFAULT_TRANSFER_DTYPE, DEFAULT_TRANSFER_KIND = wire.DTYPES[0], wire.KINDS[0]  # what a task without wire meta asks


@dataclass(frozen=True)
class ReceivedTask:
    """What the server sent with one task, as far as checking its result needs (task meta ``array_dims``,
    ``transfer_dtype``, ``transfer_kind``). Only the arrays the method keeps frozen (``Payload.frozen_keys``, e.g.
    FedBABU's random head) are copied by value, so the result can be checked to carry them unchanged."""

    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)  # zero-stride stand-ins: shape and dtype only
    dims: Mapping[str, int] = field(default_factory=dict)  # the task's named array dimensions, e.g. {"rows": 512}
    transfer_dtype: str = DEFAULT_TRANSFER_DTYPE  # how float weights travel back
    transfer_kind: str = DEFAULT_TRANSFER_KIND  # "weights" or "diff"
    frozen: Mapping[str, np.ndarray] = field(default_factory=dict)

    def as_submitted(self) -> ReceivedTask:
        """This task's weights as a ``submit_model`` answer carries them: plain weights, not encoded for the wire
        (the executor returns the site's model as it is)."""
        return ReceivedTask(self.arrays, self.dims, DEFAULT_TRANSFER_DTYPE, DEFAULT_TRANSFER_KIND, self.frozen)


class PayloadGuard(Filter):
    """Refuses any task result that carries an array or meta entry the site cannot vouch for: an undeclared or
    private key, a weight in a shape or dtype the server did not send (an image batch under a weight's name), a
    declared array whose dimensions the task did not fix, or a value that breaks the method's contract (a 20 KB
    string as ``n_samples``, a probability matrix of 5.0, NaN weights).

    Bound by the site (``local/privacy.json``) as a task data filter, it records each incoming task; as a task result
    filter it checks every result, also one with no arrays (a DXOFilter would skip it). Raising makes FLARE replace
    the result with an error reply. ``method``: the method of the privacy scope (``medflare-<method>``) the guard is
    for; a job whose plan runs another has its results refused; "" (the default scope) takes the plan's method.
    """

    # FLARE builds one filter object per privacy.json entry, so the guard that records a task and the guard that
    # checks its result are different objects: they share this record, keyed by (job, site, task name).
    _received: ClassVar[dict[tuple[str, str, str], ReceivedTask | None]] = {}

    def __init__(self, method: str = "") -> None:
        super().__init__()
        self.method = method

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        """Record an incoming task (task data chain) or check an outgoing result; the shareable is returned as it
        came."""
        task_name = str(fl_ctx.get_prop(FLContextKey.TASK_NAME) or contracts.TRAIN_PHASE)
        if self.get_prop(FilterContextKey.CHAIN_TYPE) == FilterChainType.TASK_DATA_CHAIN:
            if self.get_prop(FilterContextKey.SOURCE) == FilterSource.SITE:  # a job's own filter cannot vouch
                PayloadGuard._received[_task_key(fl_ctx, task_name)] = received_task(shareable, self._frozen(fl_ctx))
        elif shareable.get_return_code() == ReturnCode.OK:  # an error reply carries nothing
            self.check_result(shareable, fl_ctx, task_name)
        return shareable

    def check_result(self, shareable: Shareable, fl_ctx: FLContext, task_name: str) -> None:
        """Raise PayloadError unless the result's names, arrays (shapes, dtypes, values) and meta are allowed."""
        dxo = from_shareable(shareable)
        arrays, meta = dict(dxo.data or {}), dict(dxo.meta or {})
        plan = job_plan(fl_ctx)
        payload = self.payload_of(plan)
        check_result_keys(payload, list(arrays), list(meta))
        phase = contracts.TRAIN_PHASE if task_name == SUBMIT_MODEL else task_name  # both carry the weights
        sent = self.sent_with(fl_ctx, task_name, payload.is_frozen)
        contract = ContractContext(plan.task.num_classes, dims=dict(sent.dims if sent is not None else {}),
                                   multi_label=plan.task.multi_label, local_epochs=plan.max_local_epochs)
        check_result_arrays(payload, arrays, sent, phase, contract)
        check_frozen_parts(payload, arrays, sent)
        contracts.check_result_values(payload, arrays, meta, contract, phase)

    def _frozen(self, fl_ctx: FLContext) -> Callable[[str], bool]:
        """Which task arrays to record by value: the method's frozen parts (none when the job's method is unknown;
        its results are then refused at :func:`check_frozen_parts` if they carry a frozen part)."""
        try:
            return self.payload_of(job_plan(fl_ctx)).is_frozen
        except (PayloadError, MedflareError):
            return lambda name: False

    def payload_of(self, plan: RunPlan) -> Payload:
        """The declaration of the method the job's ``plan`` runs; PayloadError when it is not this guard's method
        (when it names one)."""
        if self.method and self.method != plan.method:
            raise PayloadError(f"site privacy policy: this scope's guard is for '{self.method}' results and the "
                               f"job's plan runs '{plan.method}'; its results are refused")
        return plan.spec.payload_of(plan.method_cfg)

    @classmethod
    def sent_with(
        cls, fl_ctx: FLContext, task_name: str, frozen: Callable[[str], bool] = lambda name: False
    ) -> ReceivedTask | None:
        """What the server sent with the task a result answers: the site guard's record of it, else FLARE's task
        data when the context still holds it, else None (unknown). A ``submit_model`` answer is compared with the
        last ``train`` task: the server sends no weights with it."""
        if task_name == SUBMIT_MODEL:
            train = cls._received.get(_task_key(fl_ctx, contracts.TRAIN_PHASE))
            return train.as_submitted() if train is not None else None
        recorded = cls._received.get(_task_key(fl_ctx, task_name))
        return recorded if recorded is not None else received_task(fl_ctx.get_prop(FLContextKey.TASK_DATA), frozen)


def received_task(task: Any, frozen: Callable[[str], bool] = lambda name: False) -> ReceivedTask | None:
    """The record of a task's data (None when it is not a DXO): numeric arrays as zero-stride stand-ins, so it
    costs no memory per parameter, and the arrays ``frozen`` names by value (small: e.g. a classifier head)."""
    if not isinstance(task, Shareable):
        return None
    try:
        dxo = from_shareable(task)
    except (ValueError, TypeError, KeyError):  # not a DXO
        return None
    meta = dxo.meta or {}
    arrays = {str(name): _stand_in(value) for name, value in (dxo.data or {}).items()
              if isinstance(value, np.ndarray) and value.dtype.kind in "fiub"}
    # secure_aggregation=he: the global model arrives as ciphertexts the job's DecryptTask opens after this record;
    # the task declares their shapes and dtypes, which is all a result is checked against
    arrays.update({name: stand_in(*declared) for name, declared in
                   declared_encrypted(meta, contracts.ENCRYPTED_ARRAYS).items() if name in (dxo.data or {})})
    kept = {str(name): np.array(value, copy=True) for name, value in (dxo.data or {}).items()
            if isinstance(value, np.ndarray) and frozen(str(name))}
    return ReceivedTask(arrays, _array_dims(meta.get(contracts.ARRAY_DIMS)),
                        str(meta.get(contracts.TRANSFER_DTYPE, DEFAULT_TRANSFER_DTYPE)),
                        str(meta.get(contracts.TRANSFER_KIND, DEFAULT_TRANSFER_KIND)), kept)


def check_frozen_parts(payload: Payload, arrays: Mapping[str, Any], sent: ReceivedTask | None) -> None:
    """A part the method keeps frozen leaves only as the server sent it (the server refuses it otherwise), and only
    when the site recorded what was sent."""
    frozen = sorted(key for key in arrays if payload.is_frozen(key))
    unknown = [key for key in frozen if sent is None or key not in sent.frozen]
    if unknown:
        raise PayloadError(f"site privacy policy: {unknown[:5]} must come back as the server sent them, but this site "
                           "did not record what was sent; refusing")
    if frozen and sent is not None:
        contracts.check_frozen_unchanged(
            {k: arrays[k] for k in frozen}, sent.frozen, payload, sent.transfer_dtype, sent.transfer_kind
        )


def _stand_in(array: np.ndarray) -> np.ndarray:
    """A read-only array with ``array``'s shape and dtype whose every element is one shared zero."""
    return np.broadcast_to(np.zeros((), array.dtype), array.shape)


def _array_dims(value: Any) -> dict[str, int]:
    """The task's named dimensions that are whole numbers >= 0; anything else stays unknown (and is refused)."""
    entries = value.items() if isinstance(value, dict) else ()
    return {str(name): int(size) for name, size in entries
            if isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size >= 0}


def check_result_keys(payload: Payload, array_keys: list[str], meta_keys: list[str]) -> None:
    """Raise PayloadError if a result would send a private array, an undeclared array or undeclared meta."""
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


def check_result_arrays(payload: Payload, arrays: Mapping[str, Any], sent: ReceivedTask | None, phase: str,
                        ctx: ContractContext) -> None:
    """Raise PayloadError unless every array of a result is one the site can vouch for, in its exact shape and
    dtype, with valid values: a weight the server sent in this task (:func:`returned_weights`) or an array the
    method declares for ``phase`` (``submit_model`` counts as ``train``) with every dimension known. ``sent``: None
    = unknown, and then only declared arrays may leave."""
    expected = expected_arrays(payload, list(arrays), sent, phase, ctx)
    unexpected = sorted(set(arrays) - set(expected))
    if unexpected and sent is None:
        raise PayloadError(
            f"site privacy policy: this site does not know what the server sent with task '{phase}' (no PayloadGuard "
            f"of the site's privacy.json recorded it as a task data filter, and FLARE's context holds no task data), "
            f"so only arrays the method declares for the task may leave; refusing {unexpected[:5]}")
    if unexpected:
        raise PayloadError(f"site privacy policy: the result carries arrays the server never sent to come back and "
                           f"the method does not declare for task '{phase}': {unexpected[:5]}")
    for key, value in arrays.items():
        expected[key].check(key, value, ctx)


def expected_arrays(payload: Payload, array_keys: list[str], sent: ReceivedTask | None, phase: str,
                    ctx: ContractContext) -> dict[str, Expected]:
    """key -> what may leave under it: the returnable weights, and the declared arrays among ``array_keys``
    (PayloadError when one has a dimension the task did not fix: its shape, and so its size, is unchecked)."""
    declared = {name: spec for name, spec in payload.arrays_for(phase).items() if name in array_keys}
    unresolved = sorted(name for name, spec in declared.items() if None in spec.resolved_shape(ctx))
    if unresolved:
        shapes = {name: declared[name].shape for name in unresolved}
        raise PayloadError(f"site privacy policy: the task did not fix the dimensions {shapes} (task meta "
                           f"'{contracts.ARRAY_DIMS}'), so their shape cannot be checked; refusing {unresolved}")
    return {**returned_weights(payload, sent, phase), **contracts.array_expectations(declared, ctx)}


def returned_weights(payload: Payload, sent: ReceivedTask | None, phase: str) -> dict[str, Expected]:
    """key -> Expected for the weights a ``train`` result may carry: those the server sent with the task, in the
    shape it sent, and in the dtype it sent or the job's transfer dtype (float keys only when differences travel);
    never the non-parameter arrays the method receives (``Payload.receives``)."""
    if sent is None or phase != contracts.TRAIN_PHASE or not payload.sends_weights:
        return {}
    if sent.transfer_dtype not in wire.DTYPES or sent.transfer_kind not in wire.KINDS:
        raise PayloadError(f"site privacy policy: the task asks for weights as '{sent.transfer_kind}' in "
                           f"'{sent.transfer_dtype}'; a site sends {list(wire.KINDS)} in {list(wire.DTYPES)}")
    keys = [key for key in sent.arrays if key not in payload.receives]
    return contracts.weight_expectations(sent.arrays, keys, sent.transfer_dtype, sent.transfer_kind)


def job_plan(fl_ctx: FLContext) -> RunPlan:
    """The running job's plan (``medflare_plan.json`` in its app/config folder): its method and task
    (PayloadError when it carries none readable: the site cannot tell what it may let leave)."""
    from medflare.flare.tasks import deployed_plan  # local: a guard pinned to a method reads no job

    try:
        return deployed_plan(fl_ctx)[0]
    except MedflareError as exc:
        raise PayloadError(f"site privacy policy: cannot tell which method and task this job runs: {exc}") from exc


def _task_key(fl_ctx: FLContext, task_name: str) -> tuple[str, str, str]:
    """Where a task's record is kept: per job and site (a simulator runs several in one process), per task name."""
    return str(fl_ctx.get_job_id() or ""), str(fl_ctx.get_identity_name() or ""), task_name
