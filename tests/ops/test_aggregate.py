"""Aggregation math against hand-computed cases."""

import numpy as np
import pytest

from medflare.errors import PayloadError
from medflare.ops import normalise_weights, weighted_average
from medflare.ops.aggregate import weighted_sum


def test_weighted_average_uses_normalised_scalar_weights() -> None:
    # Prepare: two sites, weights 1 and 3 -> shares 0.25 / 0.75
    updates = {"a": {"w": np.array([0.0, 4.0], dtype=np.float32)}, "b": {"w": np.array([4.0, 8.0], dtype=np.float32)}}
    # Execute
    result = weighted_average(updates, {"a": 1.0, "b": 3.0})
    # Assert: 0.25*0 + 0.75*4 = 3 ; 0.25*4 + 0.75*8 = 7
    np.testing.assert_allclose(result["w"], [3.0, 7.0])
    assert result["w"].dtype == np.float32


def test_integer_buffers_are_averaged_and_rounded_back() -> None:
    updates = {"a": {"n": np.array(10, dtype=np.int64)}, "b": {"n": np.array(13, dtype=np.int64)}}
    result = weighted_average(updates, {"a": 1.0, "b": 1.0})
    assert result["n"].dtype == np.int64 and int(result["n"]) == 12  # rint(11.5) = 12 (round half to even)


def test_row_weights_aggregate_each_row_with_its_own_weights() -> None:
    # FedLSM-style: row 0 only site a has counts, row 1 split 1:3, row 2 nobody -> scalar fallback (equal here)
    updates = {
        "a": {"head.weight": np.array([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])},
        "b": {"head.weight": np.array([[9.0, 9.0], [4.0, 8.0], [4.0, 4.0]])},
    }
    rows = {"head.weight": {"a": np.array([5.0, 1.0, 0.0]), "b": np.array([0.0, 3.0, 0.0])}}
    result = weighted_average(updates, {"a": 1.0, "b": 1.0}, row_weights=rows)
    np.testing.assert_allclose(result["head.weight"], [[1.0, 1.0], [3.0, 6.0], [3.0, 3.0]])


@pytest.mark.parametrize("weights", [{"a": -1.0, "b": 1.0}, {"a": float("nan"), "b": 1.0}, {"a": 0.0, "b": 0.0}])
def test_bad_weights_are_refused(weights: dict) -> None:
    with pytest.raises(PayloadError):
        normalise_weights(weights)


def test_nothing_to_aggregate_is_an_error() -> None:
    with pytest.raises(PayloadError, match="no site update"):
        weighted_average({}, {})


def test_weighted_sum_multiplies_half_precision_inputs_in_float64() -> None:
    # Prepare: float16 values whose products by 1/3 and 2/3 are not float16 numbers
    arrays = [np.array([1 + 2**-10, 3.0], dtype=np.float16), np.array([2049 / 1024, 0.5], dtype=np.float16)]
    weights = [1 / 3, 2 / 3]
    # Execute
    total = weighted_sum(arrays, weights)
    # Assert: exactly the float64 sum of float64 products, term by term
    expected = [weights[0] * float(a) + weights[1] * float(b) for a, b in zip(*arrays)]
    assert total.dtype == np.float64
    np.testing.assert_array_equal(total, expected)


def test_weighted_average_of_many_sites_matches_the_float64_formula() -> None:
    rng = np.random.default_rng(0)
    updates = {f"s{i}": {"w": rng.normal(size=(3, 4)).astype(np.float32)} for i in range(5)}
    weights = {f"s{i}": float(i + 1) for i in range(5)}
    result = weighted_average(updates, weights)
    total = sum(weights.values())
    expected = sum((weights[s] / total) * updates[s]["w"].astype(np.float64) for s in updates)
    np.testing.assert_allclose(result["w"], expected.astype(np.float32), rtol=0, atol=1e-7)
    assert result["w"].dtype == np.float32
