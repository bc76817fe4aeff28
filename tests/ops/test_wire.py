"""How weights travel: dtype on the wire, and weights vs differences (site encode, server decode)."""

import numpy as np
import pytest

from medflare.errors import PayloadError
from medflare.methods.base import RoundContext
from medflare.ops.wire import decode_weights, encode_weights
from medflare.registry import get_method
from medflare.server_round import RoundAggregation

GLOBAL = {"w": np.full((2, 3), 1.0, np.float32), "bn.num_batches_tracked": np.array(5, np.int64)}
LOCAL = {"w": np.full((2, 3), 1.25, np.float32), "bn.num_batches_tracked": np.array(9, np.int64)}


def test_weights_in_half_precision_halve_the_float_bytes_and_keep_integer_buffers() -> None:
    wire = encode_weights(LOCAL, GLOBAL, "float16", "weights")
    assert wire["w"].dtype == np.float16 and wire["w"].nbytes == LOCAL["w"].nbytes // 2
    assert wire["bn.num_batches_tracked"].dtype == np.int64


def test_differences_leave_integer_buffers_home_and_decode_exactly() -> None:
    wire = encode_weights(LOCAL, GLOBAL, "float32", "diff")
    assert set(wire) == {"w"}
    np.testing.assert_allclose(wire["w"], 0.25)
    decoded = decode_weights(wire, GLOBAL, "diff")
    np.testing.assert_allclose(decoded["w"], LOCAL["w"])
    with pytest.raises(PayloadError, match="did not send"):
        encode_weights(LOCAL, {}, "float32", "diff")


def core(kind: str, dtype: str = "float32") -> RoundAggregation:
    aggregation = RoundAggregation(get_method("fedavg"), {}, 3, 2, transfer_dtype=dtype, transfer_kind=kind)
    aggregation.start_round(GLOBAL, RoundContext(0, 2))
    aggregation.start_phase("train")
    return aggregation


def test_server_adds_differences_to_the_global_model_and_keeps_its_integer_buffers() -> None:
    aggregation = core("diff")
    assert set(aggregation.expected) == {"w"}
    assert aggregation.accept("site-1", encode_weights(LOCAL, GLOBAL, "float32", "diff"), {"n_samples": 4}, "diff") is None
    result = aggregation.aggregate()
    np.testing.assert_allclose(result.params["w"], 1.25)
    assert result.params["w"].dtype == np.float32 and int(result.params["bn.num_batches_tracked"]) == 5


def test_a_result_of_the_wrong_kind_or_dtype_is_rejected() -> None:
    assert "carries weights" in core("diff").accept("site-1", dict(LOCAL), {"n_samples": 4}, "weights")
    half = core("weights", "float16")
    assert "dtype" in half.accept("site-1", dict(LOCAL), {"n_samples": 4})  # float32 where float16 was asked
    assert half.accept("site-1", encode_weights(LOCAL, GLOBAL, "float16", "weights"), {"n_samples": 4}) is None
    assert half.aggregate().params["w"].dtype == np.float32  # the aggregate stays in the model's precision


def test_float32_weights_go_on_the_wire_without_another_copy() -> None:
    weights = {"w": np.ones((4, 4), np.float32), "n": np.array(3, np.int64)}
    sent = encode_weights(weights, {}, "float32", "weights")
    assert all(np.shares_memory(sent[k], weights[k]) for k in weights)  # the trainer's copy is sent as it is
    assert not np.shares_memory(encode_weights(weights, {}, "float16", "weights")["w"], weights["w"])
