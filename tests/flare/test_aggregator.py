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


def test_two_phase_round_with_declared_arrays_and_per_site_targets() -> None:
    """Phase 1 collects declared probability arrays; phase 2 sends each site its own array built from them."""
    from medflare.contracts import Payload, probabilities
    from medflare.methods.base import PerSite, ServerRule

    class ExchangeRule(ServerRule):
        def phases(self, ctx):
            return ["share_probs", "train"]

        def array_dims(self, phase, ctx):
            return {"rows": 4}

        def phase_arrays(self, phase, ctx, global_params, earlier):
            if phase == "share_probs":
                return {}
            sent = {u.site: u.arrays["probs"].astype(np.float32) for u in earlier["share_probs"]}
            return PerSite({s: {"target": sum(v for o, v in sent.items() if o != s)} for s in sent})

    payload = Payload(sends_weights=False, arrays={"probs": probabilities(phase="share_probs")}, receives=("target",))
    core = RoundAggregation("fedavg", {}, num_classes=3, num_rounds=1)
    core.spec = type(core.spec)(**{**core.spec.__dict__, "payload": payload, "server_model": False})
    core.rule = ExchangeRule(None, 1, payload)
    core.start_round({}, RoundContext(0, 1))
    assert core.start_phase("share_probs") == {}
    assert core.task_header()["array_dims"] == {"rows": 4}
    one_hot = np.eye(4, 3, dtype=np.float16)
    one_hot[3] = [1, 0, 0]
    assert core.accept("site-1", {"probs": np.full((4, 3), 1 / 3, np.float16)}, {}) is None
    assert core.accept("site-2", {"probs": one_hot}, {}) is None
    assert "shape" in core.accept("site-3", {"probs": np.ones((2, 3), np.float16)}, {})
    assert "above 1" in core.accept("site-4", {"probs": np.full((4, 3), 5.0, np.float16)}, {})
    sent = core.start_phase("train")
    assert isinstance(sent, PerSite) and set(sent.arrays) == {"site-1", "site-2"}  # rejected sites get no task
    np.testing.assert_allclose(sent.arrays["site-1"]["target"], one_hot.astype(np.float32))
    np.testing.assert_allclose(sent.arrays["site-2"]["target"], 1 / 3, rtol=1e-3)
    assert core.accept("site-1", {}, {"n_samples": 4}) is None
    result = core.aggregate()
    assert result.params == {} and result.shares == {"site-1": 1.0}



def test_array_dims_may_come_from_an_earlier_phase() -> None:
    """The rule builds a phase's task before it is asked for the phase's dimensions, so a size the sites reported
    in an earlier phase (MDH-FL's public-set size) can size the arrays of the next one."""
    from medflare.contracts import Payload, non_negative_number, probabilities
    from medflare.methods.base import ServerRule

    class SizedRule(ServerRule):
        rows = 0

        def phases(self, ctx):
            return ["report", "share", "train"]

        def phase_arrays(self, phase, ctx, global_params, earlier):
            if phase == "share":
                self.rows = int(earlier["report"][0].meta["size"])
            return {}

        def array_dims(self, phase, ctx):
            return {"rows": self.rows}

    payload = Payload(sends_weights=False, arrays={"probs": probabilities(phase="share")},
                      meta={"size": non_negative_number("size")})
    core = RoundAggregation("fedavg", {}, num_classes=3, num_rounds=1)
    core.spec = type(core.spec)(**{**core.spec.__dict__, "payload": payload, "server_model": False})
    core.rule = SizedRule(None, 1, payload)
    core.start_round({}, RoundContext(0, 1))
    core.start_phase("report")
    assert core.accept("site-1", {}, {"size": 5}) is None
    core.start_phase("share")
    assert core.task_header()["array_dims"] == {"rows": 5}
    assert core.accept("site-1", {"probs": np.full((5, 3), 1 / 3, np.float16)}, {}) is None

# ----- one site must not take over or break the aggregate (issue 7, item 3) ---------------------------------
def test_float64_weights_times_1e300_are_rejected_by_exact_dtype(core: RoundAggregation) -> None:
    arrays, meta = update(1.0)
    arrays["w"] = arrays["w"].astype(np.float64) * 1e300
    assert "dtype" in core.accept("site-1", arrays, meta)


def test_forged_sample_counts_are_rejected(core: RoundAggregation) -> None:
    assert "<= 1e+08" in core.accept("site-1", *update(1.0, n=1.79e308))
    assert core.accept("site-2", *update(1.0, n=100)) is None
    core.start_round(GLOBAL, RoundContext(1, 2))
    core.start_phase("train")
    assert "implausible" in core.accept("site-2", *update(1.0, n=100_000))  # this site reported 100 before
    assert core.accept("site-2", *update(1.0, n=120)) is None


def robust_core(**robust) -> RoundAggregation:
    core = RoundAggregation("fedavg", {}, num_classes=3, num_rounds=2, robust=robust)
    core.start_round(GLOBAL, RoundContext(0, 2))
    core.start_phase("train")
    return core


def test_norm_bound_rejects_a_scaled_update_and_keeps_the_honest_ones() -> None:
    core = robust_core(max_norm_ratio=10)
    for site, value in (("site-1", 1.0), ("site-2", 1.2), ("site-3", 1e30)):
        assert core.accept(site, *update(value)) is None  # each update is well-formed on its own
    result = core.aggregate()
    assert set(result.shares) == {"site-1", "site-2"} and "median" in core.rejected["site-3"]
    np.testing.assert_allclose(result.params["w"], 1.1, rtol=1e-6)


def test_without_the_robust_rule_a_scaled_float32_update_dominates() -> None:
    core = robust_core()  # documents why production templates switch the rule on
    for site, value in (("site-1", 1.0), ("site-2", 1e30)):
        core.accept(site, *update(value))
    assert core.aggregate().params["w"].max() > 1e29


def test_share_cap_applies_and_relaxes_when_impossible() -> None:
    core = robust_core(max_share=0.3)
    for i, n in enumerate((1000, 10, 10, 10)):
        core.accept(f"site-{i + 1}", *update(float(i), n=n))
    shares = core.aggregate().shares
    assert shares["site-1"] == pytest.approx(0.3) and sum(shares.values()) == pytest.approx(1.0)
    core = robust_core(max_share=0.3)  # one of four sites rejected: 3 x 0.3 < 1, the cap relaxes to 1/3
    for i, n in enumerate((1000, 10, 10)):
        core.accept(f"site-{i + 1}", *update(float(i), n=n))
    assert core.accept("site-4", {"w": np.zeros((9,), np.float32)}, {"n_samples": 10})  # rejected
    assert core.aggregate().shares == pytest.approx({"site-1": 1 / 3, "site-2": 1 / 3, "site-3": 1 / 3})


def test_a_non_finite_aggregate_is_refused(core: RoundAggregation) -> None:
    from medflare.errors import PayloadError
    from medflare.methods.base import AggregateResult

    core.accept("site-1", *update(1.0))
    broken = {"w": np.full((2, 3), np.inf, np.float32)}  # e.g. a rule whose math overflows
    core.rule.aggregate = lambda global_params, updates, ctx: AggregateResult(params=broken, shares={"site-1": 1.0})
    with pytest.raises(PayloadError, match="NaN/Inf"):
        core.aggregate()


def test_stages_must_add_up_to_the_rounds() -> None:
    from medflare.errors import ConfigError
    from medflare.flare.aggregator import checked_stages
    from medflare.methods.base import Stage

    stages = [Stage("pretrain", 2, scored=False), Stage("finetune", 3)]
    assert checked_stages(stages, 5, "m") == stages
    with pytest.raises(ConfigError, match="pretrain=2 \\+ finetune=3 = 5 rounds, but the job has rounds=4"):
        checked_stages(stages, 4, "m")
