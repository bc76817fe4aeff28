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


def test_two_phase_round_without_weights() -> None:
    """A logit-exchange style round: phase 1 collects an array, phase 2 sends each site what phase 1 built."""
    from medflare.contracts import Payload
    from medflare.methods.base import AggregateResult, ServerRule

    class ExchangeRule(ServerRule):
        def phases(self, ctx):
            return ["share_probs", "train"]

        def expected_arrays(self, phase, global_params, payload):
            return {"probs": ((4, 3), np.dtype(np.float32))} if phase == "share_probs" else {}

        def phase_arrays(self, phase, global_params, earlier):
            if phase == "share_probs":
                return {}
            stacked = np.stack([u.arrays["probs"] for u in earlier["share_probs"]])
            return {"mean_probs": stacked.mean(axis=0)}

        def aggregate(self, global_params, updates, ctx):
            return AggregateResult(params=dict(global_params), shares={u.site: 1 / len(updates) for u in updates})

    core = RoundAggregation("fedavg", {}, num_classes=3, num_rounds=1)
    core.rule = ExchangeRule(None, 1)
    core.spec = type(core.spec)(**{**core.spec.__dict__, "payload": Payload(sends_weights=False, arrays=("probs",))})
    core.start_round({}, RoundContext(0, 1))
    assert core.start_phase("share_probs") == {}
    assert core.accept("site-1", {"probs": np.zeros((4, 3), np.float32)}, {}) is None
    assert core.accept("site-2", {"probs": np.ones((4, 3), np.float32)}, {}) is None
    assert "shape" in core.accept("site-3", {"probs": np.ones((2, 3), np.float32)}, {})
    sent = core.start_phase("train")
    np.testing.assert_allclose(sent["mean_probs"], 0.5)
    assert core.accept("site-1", {}, {"n_samples": 4}) is None
    assert core.aggregate().shares == {"site-1": 1.0}
