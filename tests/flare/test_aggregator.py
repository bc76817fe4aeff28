"""Server-side round aggregation: validation of every update and the weighting rule, without FLARE."""

import numpy as np
import pytest

from medflare.flare.aggregator import RoundAggregation
from medflare.methods.base import RoundContext

GLOBAL = {"w": np.zeros((2, 3), np.float32), "bn.num_batches_tracked": np.array(0, np.int64)}


def update(value: float, n: int = 10) -> tuple[dict, dict]:
    arrays = {"w": np.full((2, 3), value, np.float32), "bn.num_batches_tracked": np.array(4, np.int64)}
    return arrays, {"n_samples": n}


@pytest.fixture
def core() -> RoundAggregation:
    aggregation = RoundAggregation("fedavg", {}, num_classes=3, num_rounds=2)
    aggregation.start_round(GLOBAL, RoundContext(0, 2))
    aggregation.start_phase("train")
    return aggregation


def test_sample_count_weights(core: RoundAggregation) -> None:
    assert core.accept("site-1", *update(1.0, n=10)) is None
    assert core.accept("site-2", *update(4.0, n=30)) is None
    result = core.aggregate()
    np.testing.assert_allclose(result.params["w"], np.full((2, 3), 0.25 * 1 + 0.75 * 4))
    assert result.shares == pytest.approx({"site-1": 0.25, "site-2": 0.75})
    assert int(result.params["bn.num_batches_tracked"]) == 4


def test_nan_update_is_rejected_and_the_round_goes_on(core: RoundAggregation) -> None:
    arrays, meta = update(1.0)
    arrays["w"][0, 0] = np.nan
    assert "NaN" in core.accept("site-1", arrays, meta)
    assert core.accept("site-2", *update(2.0)) is None
    result = core.aggregate()
    np.testing.assert_allclose(result.params["w"], 2.0)
    assert set(result.shares) == {"site-2"} and "site-1" in core.rejected


@pytest.mark.parametrize(
    "arrays, meta, reason",
    [
        ({"w": np.zeros((3, 2), np.float32), "bn.num_batches_tracked": np.array(1)}, {"n_samples": 5}, "shape"),
        ({"w": np.zeros((2, 3), np.float32)}, {"n_samples": 5}, "missing"),
        (update(1.0)[0], {}, "n_samples"),  # no weight -> cannot be aggregated
        (update(1.0)[0], {"n_samples": 5, "label_histogram": [1, 2, 3]}, "undeclared"),
    ],
)
def test_malformed_updates_are_rejected(core: RoundAggregation, arrays: dict, meta: dict, reason: str) -> None:
    assert reason in core.accept("site-1", arrays, meta)
    assert not core.updates


def test_duplicate_update_in_one_round_is_rejected(core: RoundAggregation) -> None:
    core.accept("site-1", *update(1.0))
    assert "second update" in core.accept("site-1", *update(9.0))


def test_start_round_forgets_the_previous_round(core: RoundAggregation) -> None:
    core.accept("site-1", *update(1.0))
    core.start_round(GLOBAL, RoundContext(1, 2))
    assert not core.updates and not core.rejected
