"""The global model travelling to the sites in float16 (``download_dtype``), without FLARE's simulator: the task's
float weights are float16 and their bytes halve, integer buffers and a method's own arrays travel as they are, the
site's model is the float16-rounded global model in its own float32, and every check on what the site sends back
(dtype, finite values, the frozen parts, the server's update-norm bound) still applies."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal

from medflare import contracts
from medflare.contracts import ContractContext
from medflare.deploy.filters import check_result_arrays, received_task
from medflare.errors import ConfigError, PayloadError
from medflare.flare.controller import TASK_BYTES, MedflareController
from medflare.methods.base import PerSite, RoundContext
from medflare.ops.wire import encode_download, encode_weights
from medflare.plan import build_global_model
from medflare.registry import get_method
from medflare.server_round import RoundAggregation
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

from .._plans import site_data_plan

K = 5
TASK = TaskSpec(num_classes=K, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=200", "partition": "iid", "num_sites": 2}
CTX = RoundContext(round=0, total_rounds=2)


def global_model(method: str = "fedavg") -> dict[str, np.ndarray]:
    model = build_global_model(method, "cnn", K, TASK.in_channels, TASK.image_size, seed=7)
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def rounded(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The global model as a float16 download leaves it at a site: float16 values, back in the model's dtype."""
    return {k: v.astype(np.float16).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in params.items()}


def core(download_dtype: str, method: str = "fedavg", **options) -> RoundAggregation:
    aggregation = RoundAggregation(get_method(method), {}, K, 2, download_dtype=download_dtype, **options)
    aggregation.start_round(global_model(method), CTX)
    return aggregation


def sent_task(download_dtype: str) -> tuple[dict, dict]:
    """(the train task's arrays as FLARE would carry them, the round's record) from the controller's _send_phase."""
    aggregation, tasks, record = core(download_dtype), [], {}
    ctl = MedflareController().use_plan(site_data_plan(rounds=2))
    ctl.aggregator = SimpleNamespace(core=aggregation)
    ctl.broadcast = lambda task, fl_ctx, **kw: tasks.append(task)
    ctl._wait_for_answers = lambda tasks, answers, abort, fl_ctx: None
    ctl._send_phase("train", aggregation.start_phase("train"), CTX, record, {}, Signal(), FLContext())
    (task,) = tasks
    return from_shareable(task.data).data, record


def test_the_broadcast_carries_float16_weights_and_integer_buffers_as_they_are() -> None:
    full, full_record = sent_task("float32")
    half, half_record = sent_task("float16")
    floats = [k for k, v in full.items() if v.dtype.kind == "f"]
    integers = [k for k, v in full.items() if v.dtype.kind != "f"]
    assert floats and integers  # the cnn has BatchNorm counters
    assert all(full[k].dtype == np.float32 for k in floats) and all(half[k].dtype == np.float16 for k in floats)
    assert all(half[k].dtype == full[k].dtype and np.array_equal(half[k], full[k]) for k in integers)
    float_bytes = sum(full[k].nbytes for k in floats)
    assert full_record[TASK_BYTES]["train"] - half_record[TASK_BYTES]["train"] == float_bytes // 2  # same meta


def test_the_server_keeps_its_model_in_float32() -> None:
    aggregation = core("float16")
    aggregation.start_phase("train")
    assert all(v.dtype in (np.float32, np.int64) for v in aggregation.global_params.values())


def test_the_sites_model_is_the_float16_rounded_global_model() -> None:
    runtime = SiteRuntime(SiteSettings(get_method("fedavg"), TASK, DATA), "site-1", 0, log=lambda line: None)
    half, _ = sent_task("float16")
    runtime.validate(half)
    loaded = {k: v.numpy() for k, v in runtime.trainer.model.state_dict().items()}
    exact = global_model()
    expected = rounded(exact)
    assert set(expected) <= set(loaded)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and np.array_equal(loaded[key], value), key
    assert any(not np.array_equal(value, exact[key]) for key, value in expected.items())  # it did round


def test_a_weight_float16_cannot_hold_keeps_its_dtype_and_a_methods_own_arrays_are_untouched() -> None:
    arrays = {"w": np.full(3, 7e4, np.float32), "v": np.ones(2, np.float32), "probs": np.ones(2, np.float32),
              "n": np.arange(2)}
    wire = encode_download(arrays, {"w", "v", "n"}, "float16")
    assert wire["w"].dtype == np.float32 and np.isfinite(wire["w"]).all()  # never an overflowed infinity
    assert wire["v"].dtype == np.float16 and wire["probs"].dtype == np.float32 and wire["n"].dtype == np.int64
    assert encode_download(arrays, set(arrays), "float32") == arrays  # the default sends the model as it is


def test_per_site_tasks_are_narrowed_too() -> None:
    aggregation = core("float16")
    aggregation.rule.phase_arrays = lambda phase, ctx, params, earlier: PerSite({"site-1": dict(params)})
    (arrays,) = aggregation.start_phase("train").arrays.values()
    assert {v.dtype for v in arrays.values()} == {np.dtype(np.float16), np.dtype(np.int64)}


def test_an_unknown_download_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="download_dtype"):
        RoundAggregation(get_method("fedavg"), {}, K, 2, download_dtype="bfloat16")


@pytest.mark.parametrize("transfer_dtype", ["float32", "float16"])
def test_the_site_and_the_server_still_check_what_comes_back(transfer_dtype: str) -> None:
    aggregation = core("float16", transfer_dtype=transfer_dtype)
    half = aggregation.start_phase("train")
    trained = {k: v + np.float32(0.01) if v.dtype.kind == "f" else v for k, v in rounded(global_model()).items()}
    result = encode_weights(trained, half, transfer_dtype, "weights")
    task = DXO(DataKind.WEIGHTS, data=half, meta={contracts.TRANSFER_DTYPE: transfer_dtype}).to_shareable()
    sent = received_task(task)  # what the site's guard records of the task
    payload, ctx = get_method("fedavg").payload, ContractContext(K)
    check_result_arrays(payload, result, sent, "train", ctx)  # the site's guard lets an honest result go
    key = next(k for k, v in result.items() if v.dtype.kind == "f")
    broken = {**result, key: np.full_like(result[key], np.nan)}
    with pytest.raises(PayloadError, match="NaN|finite"):
        check_result_arrays(payload, broken, sent, "train", ctx)
    assert aggregation.accept("site-1", result, {contracts.N_SAMPLES: 10}) is None  # the server takes it
    assert "NaN" in aggregation.accept("site-2", broken, {contracts.N_SAMPLES: 10})


def test_the_update_norm_bound_still_applies() -> None:
    aggregation = core("float16", robust={"max_norm_ratio": 3.0})
    half = aggregation.start_phase("train")
    base = rounded(global_model())
    for index, step in enumerate((0.01, 0.012, 0.011, 5.0)):  # the last site's update is ~450x the others'
        moved = {k: v + np.float32(step) if v.dtype.kind == "f" else v for k, v in base.items()}
        assert aggregation.accept(f"site-{index + 1}", encode_weights(moved, half, "float32", "weights"),
                                  {contracts.N_SAMPLES: 10}) is None
    result = aggregation.aggregate()
    assert set(result.shares) == {"site-1", "site-2", "site-3"} and "update norm" in aggregation.rejected["site-4"]


def test_a_frozen_part_that_came_back_as_the_site_received_it_is_accepted() -> None:
    """FedBABU's frozen head travels down as float16 and back as float32: unchanged is the float16 value."""
    aggregation = core("float16", method="fedbabu")
    half = aggregation.start_phase("train")
    frozen = [k for k in half if aggregation.spec.payload.is_frozen(k)]
    assert frozen
    honest = encode_weights(rounded(global_model("fedbabu")), half, "float32", "weights")
    assert aggregation.accept("site-1", honest, {contracts.N_SAMPLES: 10}) is None
    moved = {**honest, frozen[0]: honest[frozen[0]] + np.float32(0.5)}
    assert "frozen" in aggregation.accept("site-2", moved, {contracts.N_SAMPLES: 10})
