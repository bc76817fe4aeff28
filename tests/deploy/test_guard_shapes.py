"""A site's own filter (PayloadGuard) refuses what the server would: every array is checked for its shape, dtype
and values against what the server sent with the task or what the method declares, not only for its name
(issue 26, item 5).

FLARE 2.9's client runner clears the task data from the context before it runs the result filters, so the guard
records each task it lets in as a task data filter, and refuses (fails closed) what it cannot compare.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import FilterChainType, FilterContextKey, FilterSource
from nvflare.apis.fl_constant import FilterKey, FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.utils.task_utils import apply_filters
from nvflare.private.privacy_manager import Scope

from medflare import contracts
from medflare.console.deploy.policies import scope_name
from medflare.deploy.filters import SUBMIT_MODEL, PayloadGuard
from medflare.errors import PayloadError
from medflare.methods.fedlsm.server import LABEL_COUNTS, NEGATIVES, POS_WEIGHT, POSITIVES
from medflare.methods.mdhfl.protocol import PROBS, PROBS_PHASE
from medflare.ops import wire

from .test_provision_and_policies import K, flare_privacy_manager, guard_context

CONV, BN = "conv.weight", "bn.num_batches_tracked"
SENT = {CONV: np.linspace(-1, 1, 108, dtype=np.float32).reshape(4, 3, 3, 3), BN: np.array(7, np.int64)}
IMAGES = np.zeros((5, 28, 28, 1), np.float32)  # an image batch, the shape of the probe's smuggled array


@pytest.fixture(autouse=True)
def fresh_records(monkeypatch) -> None:
    """Each test starts with a guard that has let no task in (the record is shared by every PayloadGuard)."""
    monkeypatch.setattr(PayloadGuard, "_received", {}, raising=False)


def wire_meta(dtype: str = "float32", kind: str = "weights", **dims: int) -> dict:
    """The task meta the server's aggregator writes: the array dimensions and the job's wire format."""
    return {contracts.ARRAY_DIMS: dims, contracts.TRANSFER_DTYPE: dtype, contracts.TRANSFER_KIND: kind}


def result(arrays: dict, meta: dict | None = None) -> Shareable:
    return DXO(DataKind.WEIGHTS, data=arrays, meta={"n_samples": 12} if meta is None else meta).to_shareable()


def without_task_data(ctx: FLContext) -> FLContext:
    """The context as FLARE 2.9 hands it to result filters: the runner set TASK_DATA to None after execution."""
    ctx.set_prop(FLContextKey.TASK_DATA, None, private=True, sticky=False)
    return ctx


def trained(scale: float = 0.5) -> dict[str, np.ndarray]:
    """A site's model after local training: the server's weights changed, the step counter advanced."""
    return {CONV: SENT[CONV] * scale, BN: np.array(9, np.int64)}


def uniform_probs(rows: int, dtype: str = "float16") -> np.ndarray:
    return np.full((rows, K), 1 / K, dtype=dtype)


@pytest.mark.parametrize(("probe", "reason"), [
    ("image batch under a weight's name", "shape"),
    ("float64 weight the server sent as float32", "dtype"),
    ("extra array without task data", "does not know what the server sent"),
    ("probabilities without array_dims", "did not fix the dimensions"),
])
def test_each_probe_is_refused(probe: str, reason: str, tmp_path: Path) -> None:
    """Each of these passed the names-only guard."""
    method, task_name, ctx = "fedavg", "train", guard_context(tmp_path, "fedavg", SENT, task_meta=wire_meta())
    if probe == "image batch under a weight's name":
        arrays = {**SENT, CONV: IMAGES}
    elif probe == "float64 weight the server sent as float32":
        arrays = {**SENT, CONV: SENT[CONV].astype(np.float64)}
    elif probe == "extra array without task data":
        ctx, arrays = without_task_data(ctx), {**SENT, "stolen_images": IMAGES}
    else:
        method, task_name = "mdhfl", PROBS_PHASE
        ctx, arrays = guard_context(tmp_path, method, task_name=task_name, task_meta={}), {PROBS: uniform_probs(100)}
    with pytest.raises(PayloadError, match=reason):
        PayloadGuard(method).process(result(arrays, {}), ctx)


@pytest.mark.parametrize("dtype", wire.DTYPES)
@pytest.mark.parametrize("kind", wire.KINDS)
def test_a_site_answer_in_the_jobs_wire_format_passes_and_another_dtype_does_not(
    dtype: str, kind: str, tmp_path: Path
) -> None:
    arrays = wire.encode_weights(trained(), SENT, dtype, kind)  # exactly what the site runtime sends
    ctx = guard_context(tmp_path, "fedavg", SENT, task_meta=wire_meta(dtype, kind))
    ok = result(arrays)
    assert PayloadGuard("fedavg").process(ok, ctx) is ok
    other = "float16" if dtype == "float32" else "float32"
    with pytest.raises(PayloadError, match="dtype"):
        PayloadGuard("fedavg").process(result({**arrays, CONV: arrays[CONV].astype(other)}), ctx)
    if kind == "diff":  # integer buffers stay at the site when differences travel
        with pytest.raises(PayloadError, match="never sent"):
            PayloadGuard("fedavg").process(result({**arrays, BN: trained()[BN]}), ctx)


def test_weights_come_back_with_valid_values_and_never_as_what_the_method_only_receives(tmp_path: Path) -> None:
    ctx = guard_context(tmp_path, "fedlsm", {**SENT, POS_WEIGHT: np.ones(K, np.float32)}, task_meta=wire_meta())
    with pytest.raises(PayloadError, match="never sent"):
        PayloadGuard("fedlsm").process(result({**trained(), POS_WEIGHT: np.ones(K, np.float32)}), ctx)
    with pytest.raises(PayloadError, match=BN):  # a step counter is a whole count >= 0
        PayloadGuard("fedlsm").process(result({**trained(), BN: np.array(-3, np.int64)}), ctx)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_declared_probabilities_pass_with_the_rows_the_task_fixed(dtype: str, tmp_path: Path) -> None:
    ctx = guard_context(tmp_path, "mdhfl", task_name=PROBS_PHASE, task_meta=wire_meta(rows=6))
    ok = result({PROBS: uniform_probs(6, dtype)}, {})
    assert PayloadGuard("mdhfl").process(ok, ctx) is ok
    with pytest.raises(PayloadError, match="shape"):
        PayloadGuard("mdhfl").process(result({PROBS: uniform_probs(100, dtype)}, {}), ctx)


def test_without_task_data_only_declared_arrays_with_known_dimensions_leave(tmp_path: Path) -> None:
    """Nothing tells the guard what the server sent: weights are refused, so is a declared array whose rows the
    task would have fixed; declared arrays whose shape the method fixes itself, and meta, still leave."""
    counts = {POSITIVES: np.array([3, 0, 5], np.int64), NEGATIVES: np.array([9, 12, 7], np.int64)}
    ok = result(counts, {})
    counts_ctx = without_task_data(guard_context(tmp_path, "fedlsm", task_name=LABEL_COUNTS))
    assert PayloadGuard("fedlsm").process(ok, counts_ctx) is ok
    ctx = without_task_data(guard_context(tmp_path, "fedavg", SENT))
    scores_only = result({})
    assert PayloadGuard("fedavg").process(scores_only, ctx) is scores_only
    with pytest.raises(PayloadError, match="does not know what the server sent"):
        PayloadGuard("fedavg").process(result(trained()), ctx)
    probs_ctx = without_task_data(guard_context(tmp_path, "mdhfl", task_name=PROBS_PHASE))
    with pytest.raises(PayloadError, match="did not fix the dimensions"):
        PayloadGuard("mdhfl").process(result({PROBS: uniform_probs(4)}, {}), probs_ctx)


def site_context(app: Path, method: str, scope: Scope, job: str = "job-1", site: str = "site-1") -> FLContext:
    """A site's per-task context as FLARE's client runner builds it: the job, the site, the job's privacy scope."""
    ctx = guard_context(app, method, SENT, task_meta=wire_meta("float16"))
    ctx.set_prop(FLContextKey.CURRENT_RUN, job, private=False, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
    ctx.set_prop(FLContextKey.SCOPE_OBJECT, scope, private=True, sticky=False)
    return ctx


def run_task(ctx: FLContext, task_name: str, task: Shareable | None, answer: Shareable) -> Shareable:
    """FLARE 2.9's ClientRunner._do_task around the executor: the scope's task data filters, TASK_DATA cleared
    after execution, then the scope's task result filters (``task`` None: the task data filters already ran)."""
    ctx.set_prop(FLContextKey.TASK_NAME, task_name, private=True, sticky=False)
    if task is not None:
        assert apply_filters(Scope.TASK_DATA_FILTERS_NAME, task, ctx, {}, task_name, FilterKey.IN) is task
    without_task_data(ctx)
    return apply_filters(Scope.TASK_RESULT_FILTERS_NAME, answer, ctx, {}, task_name, FilterKey.OUT)


def test_bound_on_both_sides_the_guard_compares_with_the_task_flare_no_longer_holds(tmp_path: Path) -> None:
    """The site's privacy.json, built by FLARE's own parser; the filters applied by FLARE's own apply_filters."""
    scope = flare_privacy_manager(tmp_path / "kit").get_scope(scope_name("fedavg"))
    ctx = site_context(tmp_path / "app", "fedavg", scope)
    task = DXO(DataKind.WEIGHTS, data=SENT, meta=wire_meta("float16")).to_shareable()
    ok = result(wire.encode_weights(trained(), SENT, "float16", "weights"))
    assert run_task(ctx, "train", task, ok) is ok
    with pytest.raises(PayloadError, match="shape"):
        run_task(ctx, "train", task, result({**from_shareable(ok).data, CONV: IMAGES.astype(np.float16)}))
    recorded = PayloadGuard.sent_with(ctx, "train")
    assert recorded is not None and all(a.strides == (0,) * a.ndim for a in recorded.arrays.values())  # no values
    submitted = result(trained(), {})  # a submitted model: plain weights, compared with the last train task
    assert run_task(ctx, SUBMIT_MODEL, None, submitted) is submitted
    with pytest.raises(PayloadError, match="dtype"):
        run_task(ctx, SUBMIT_MODEL, None, result({CONV: trained()[CONV].astype(np.float64)}, {}))
    other_site = site_context(tmp_path / "app", "fedavg", scope, site="site-2")
    with pytest.raises(PayloadError, match="does not know what the server sent"):
        run_task(other_site, "train", None, ok)  # another site's (or job's) record is not this one's


def test_a_guard_a_job_binds_records_nothing(tmp_path: Path) -> None:
    """Only the site's own guard may say what the server sent; a job's task data filter could see altered data."""
    guard = PayloadGuard("fedavg")
    guard.set_prop(FilterContextKey.CHAIN_TYPE, FilterChainType.TASK_DATA_CHAIN)
    guard.set_prop(FilterContextKey.SOURCE, FilterSource.JOB)
    ctx = guard_context(tmp_path, "fedavg", SENT, task_meta=wire_meta())
    task = ctx.get_prop(FLContextKey.TASK_DATA)
    assert guard.process(task, ctx) is task
    with pytest.raises(PayloadError, match="does not know what the server sent"):
        PayloadGuard("fedavg").process(result(trained()), without_task_data(ctx))


def test_a_frozen_part_leaves_only_as_the_server_sent_it(tmp_path: Path) -> None:
    """FedBABU's random head travels but is frozen: the server refuses a changed one, so the site's filter does too
    (it records the frozen arrays' values, and only those)."""
    head = {"head.weight": np.linspace(-1, 1, 6, dtype=np.float32).reshape(K, 2), "head.bias": np.zeros(K, np.float32)}
    sent = {**SENT, **head}
    scope = flare_privacy_manager(tmp_path / "kit").get_scope(scope_name("fedbabu"))
    ctx = site_context(tmp_path / "app", "fedbabu", scope)
    task = DXO(DataKind.WEIGHTS, data=sent, meta=wire_meta("float16")).to_shareable()
    honest = result(wire.encode_weights({**trained(), **head}, sent, "float16", "weights"))
    assert run_task(ctx, "train", task, honest) is honest
    moved = {**head, "head.weight": head["head.weight"] * -3.0}
    with pytest.raises(PayloadError, match="'head.weight' is frozen"):
        run_task(ctx, "train", task, result(wire.encode_weights({**trained(), **moved}, sent, "float16", "weights")))
    recorded = PayloadGuard.sent_with(ctx, "train")
    assert set(recorded.frozen) == set(head)  # the body is recorded by shape only
    with pytest.raises(PayloadError, match="does not know what the server sent"):  # nothing recorded: fail closed
        PayloadGuard("fedbabu").process(honest, without_task_data(guard_context(tmp_path / "other", "fedbabu")))
