"""Server-side round aggregation: validation of every update and the weighting rule, without FLARE."""

import itertools
import re

import numpy as np
import pytest

from medflare.methods.base import RoundContext
from medflare.registry import get_method
from medflare.server_round import RoundAggregation

from .._plans import run_plan, site_data_plan

GLOBAL = {"w": np.zeros((2, 3), np.float32), "bn.num_batches_tracked": np.array(0, np.int64)}


def update(value: float, n: int = 10) -> tuple[dict, dict]:
    arrays = {"w": np.full((2, 3), value, np.float32), "bn.num_batches_tracked": np.array(4, np.int64)}
    return arrays, {"n_samples": n}


@pytest.fixture
def core() -> RoundAggregation:
    aggregation = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=2)
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
    core = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=1)
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
    core = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=1)
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


def robust_core(min_clients: int = 1, **robust) -> RoundAggregation:
    core = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=2, robust=robust, min_clients=min_clients)
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


def test_with_two_sites_a_tiny_update_evicts_nobody_and_the_round_says_why() -> None:
    """With two sites each one's reference median is the other's norm: a hostile step 1/11 of the honest one's used
    to get the honest site rejected, the hostile one aggregated alone with share 1.0 (issue 49, item 1)."""
    core = robust_core(min_clients=2, max_norm_ratio=10, max_share=0.6)
    assert core.accept("site-1", *update(1.0)) is None  # honest
    assert core.accept("site-2", *update(1.0 / 11)) is None  # hostile: a tiny step
    result = core.aggregate()
    assert core.rejected == {} and set(result.shares) == {"site-1", "site-2"}
    assert max(result.shares.values()) == pytest.approx(0.5)  # equal n_samples: neither takes over
    assert result.info["norm_bound"].startswith("not applied: 2 sites answered")


def test_a_robust_rejection_that_leaves_fewer_than_min_clients_fails_the_round_naming_every_site() -> None:
    from medflare.errors import PayloadError

    core = robust_core(min_clients=3, max_norm_ratio=10)
    for site, value in (("site-1", 1.0), ("site-2", 1.2), ("site-3", 1e30)):
        assert core.accept(site, *update(value)) is None
    with pytest.raises(PayloadError) as failed:
        core.aggregate()
    message = str(failed.value)
    assert all(site in message for site in ("site-1", "site-2", "site-3")) and "min_clients=3" in message
    assert "previous global model is kept" in message


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


def test_multi_krum_rejects_the_far_site_with_its_score_and_fedavg_weighs_the_rest() -> None:
    core = robust_core(min_clients=3, rule="multi_krum", hostile_sites=1)  # keeps n - f = 4 of 5
    for i, (value, n) in enumerate(((1.0, 10), (1.1, 30), (0.9, 10), (1.0, 50), (40.0, 10))):
        assert core.accept(f"site-{i + 1}", *update(value, n=n)) is None
    result = core.aggregate()
    assert set(result.shares) == {"site-1", "site-2", "site-3", "site-4"}
    assert "Krum score" in core.rejected["site-5"] and "robust.rule=multi_krum" in core.rejected["site-5"]
    np.testing.assert_allclose(result.params["w"], (10 * 1.0 + 30 * 1.1 + 10 * 0.9 + 50 * 1.0) / 100, rtol=1e-6)


def test_the_median_rule_takes_the_share_weighted_median_under_the_cap() -> None:
    core = robust_core(rule="median", max_share=0.4)
    for i, (value, n) in enumerate(((0.0, 980), (1.0, 10), (7.0, 10))):
        assert core.accept(f"site-{i + 1}", *update(value, n=n)) is None
    result = core.aggregate()  # site-1 asks for 0.98, the cap leaves it 0.4: the median is site-2's value
    np.testing.assert_array_equal(result.params["w"], 1.0)
    assert result.shares["site-1"] == pytest.approx(0.4) and core.rejected == {}


def test_bulyan_needs_4f_plus_3_answers_and_keeps_the_honest_values() -> None:
    from medflare.errors import PayloadError

    core = robust_core(min_clients=5, rule="bulyan", hostile_sites=1)
    values = (1.0, 1.1, 0.9, 1.05, 0.95, 1.0, -60.0)
    for i, value in enumerate(values):
        assert core.accept(f"site-{i + 1}", *update(value)) is None
    result = core.aggregate()
    assert "site-7" in core.rejected and len(result.shares) == 5  # theta = n - 2f Krum picks
    assert 0.9 <= float(result.params["w"][0, 0]) <= 1.1
    core = robust_core(rule="bulyan", hostile_sites=1)
    for i, value in enumerate(values[:6]):
        core.accept(f"site-{i + 1}", *update(value))
    with pytest.raises(PayloadError, match="needs at least 7 sites; 6 answered"):
        core.aggregate()


@pytest.mark.parametrize("robust, min_clients, words", [
    ({"rule": "krum"}, 2, "keeps 1 site(s) per round and the job needs min_clients=2"),
    ({"rule": "multi_krum", "krum_keep": 2}, 3, "keeps 2 site(s)"),
])
def test_a_rule_that_keeps_fewer_sites_than_min_clients_is_refused(robust: dict, min_clients: int, words: str) -> None:
    from medflare.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(words)):
        robust_core(min_clients=min_clients, **robust)


def test_rules_that_cannot_compose_are_refused_with_the_reason() -> None:
    from medflare.errors import ConfigError
    from medflare.ops.he_aggregate import encrypted_run_problems
    from medflare.registry import get_method
    from medflare.run_config import RunConfig
    from medflare.server_setup import typed_robust

    with pytest.raises(ConfigError, match="method 'mdhfl' has no global model"):
        RoundAggregation(get_method("mdhfl"), {}, num_classes=3, num_rounds=2, robust={"rule": "median", "max_share": 0.45})
    with pytest.raises(ConfigError, match="set robust.max_share below 0.5"):
        typed_robust({"rule": "median", "max_share": 0.6})
    with pytest.raises(ConfigError, match="set robust.max_share at most trim_fraction=0.2"):
        typed_robust({"rule": "trimmed_mean", "max_share": 0.3})
    assert any("robust.rule=median" in p for p in encrypted_run_problems(get_method("fedavg"), robust_rule="median"))
    with pytest.raises(ConfigError, match="robust.trim_fraction is an option of another rule"):
        typed_robust({"rule": "median", "trim_fraction": 0.3, "max_share": 0.45})
    with pytest.raises(ConfigError, match="robust.rule=krum keeps one on"):
        typed_robust({"off": True, "rule": "krum"})
    with pytest.raises(ConfigError, match="needs at least 7 sites; the job has 3"):
        run_plan(RunConfig(method="fedavg", clients=3, robust={"rule": "bulyan"}))
    core = robust_core(rule="trimmed_mean", max_share=0.2)
    core.stream_aggregation = True
    assert "robust.rule=trimmed_mean" in core.batch_reason()


def test_a_non_finite_aggregate_is_refused(core: RoundAggregation, monkeypatch: pytest.MonkeyPatch) -> None:
    from medflare import server_round
    from medflare.errors import PayloadError
    from medflare.methods.base import AggregateResult

    core.accept("site-1", *update(1.0))
    broken = {"w": np.full((2, 3), np.inf, np.float32)}  # e.g. combining math that overflows
    monkeypatch.setattr(server_round, "aggregate_updates",
                        lambda *args: AggregateResult(params=broken, shares={"site-1": 1.0}))
    with pytest.raises(PayloadError, match="NaN/Inf"):
        core.aggregate()


def test_stages_must_add_up_to_the_rounds() -> None:
    from medflare.errors import ConfigError
    from medflare.methods.base import Stage
    from medflare.server_setup import checked_stages

    stages = [Stage("pretrain", 2, scored=False), Stage("finetune", 3)]
    assert checked_stages(stages, 5, "m") == stages
    with pytest.raises(ConfigError, match="pretrain=2 \\+ finetune=3 = 5 rounds, but the job has rounds=4"):
        checked_stages(stages, 4, "m")


# ----- stream_aggregation: results summed in site order as they arrive (issue 15, item 4) -------------------------
STREAM_GLOBAL = {"w": np.zeros(3, np.float64), "bn.num_batches_tracked": np.array(0, np.int64)}  # float64: 1e-12


def streaming_core(method: str = "fedavg", sites=None, **options) -> RoundAggregation:
    aggregation = RoundAggregation(get_method(method), options.pop("method_args", {}), num_classes=3, num_rounds=2,
                                   stream_aggregation=True, **options)
    aggregation.start_round(STREAM_GLOBAL, RoundContext(0, 2))
    aggregation.start_phase("train")
    if sites is not None:
        aggregation.expect_sites(sites)
    return aggregation


def stream_update(values: list[float], n: int) -> tuple[dict, dict]:
    arrays = {"w": np.array(values, np.float32), "bn.num_batches_tracked": np.array(n // 2, np.int64)}
    return arrays, {"n_samples": n}


HAND = {"site-1": ([1.0, 2.0, -4.0], 10), "site-2": ([3.0, 0.5, 8.0], 30), "site-3": ([-1.0, 6.0, 2.0], 60)}


def test_a_streamed_round_is_the_weighted_sum_over_the_weights_and_matches_the_batch_path() -> None:
    core = streaming_core(sites=list(HAND))
    for site in ("site-3", "site-1", "site-2"):
        assert core.accept(site, *stream_update(*HAND[site])) is None
    result = core.aggregate()
    # (10 a1 + 30 a2 + 60 a3) / 100, and the batches tracked (10 5 + 30 15 + 60 30) / 100 = 23
    by_hand = [(10 * 1 + 30 * 3 + 60 * -1) / 100, (10 * 2 + 30 * 0.5 + 60 * 6) / 100, (10 * -4 + 30 * 8 + 60 * 2) / 100]
    np.testing.assert_allclose(result.params["w"], by_hand, rtol=1e-15)
    assert int(result.params["bn.num_batches_tracked"]) == 23
    assert result.shares == pytest.approx({"site-1": 0.1, "site-2": 0.3, "site-3": 0.6})
    assert result.info["stream_aggregation"] == {"mode": "streamed", "most_results_held": 1, "in_site_order": True}
    batch = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=2)
    batch.start_round(STREAM_GLOBAL, RoundContext(0, 2))
    batch.start_phase("train")
    for site, (values, n) in HAND.items():
        batch.accept(site, *stream_update(values, n))
    theirs = batch.aggregate()
    np.testing.assert_allclose(result.params["w"], theirs.params["w"], rtol=1e-12, atol=1e-12)
    assert result.shares == theirs.shares and "stream_aggregation" not in theirs.info  # off: records unchanged


def test_streamed_results_leave_no_model_copy_behind() -> None:
    core = streaming_core(sites=list(HAND))
    for site in sorted(HAND):  # in site order nothing waits: each result goes straight into the sum
        core.accept(site, *stream_update(*HAND[site]))
        assert not core.stream.waiting
    assert all(update.arrays == {} for update in core.updates.values())  # meta only
    sums = core.stream.total.sums
    assert {k: v.dtype for k, v in sums.items()} == {"w": np.float64, "bn.num_batches_tracked": np.float64}
    reverse = streaming_core(sites=list(HAND))
    reverse.accept("site-3", *stream_update(*HAND["site-3"]))
    reverse.accept("site-2", *stream_update(*HAND["site-2"]))
    assert sorted(reverse.stream.waiting) == ["site-2", "site-3"]  # they wait for site-1
    reverse.accept("site-1", *stream_update(*HAND["site-1"]))
    assert not reverse.stream.waiting and list(reverse.stream.total.weights) == sorted(HAND)


def test_a_rejected_update_never_enters_the_sum_and_a_missing_site_does_not_change_the_bits() -> None:
    """site-2 sends NaN (rejected), site-5 was sent the task but never answers; every arrival order of the rest
    gives the same bytes, and they equal a round in which only sites 1, 3 and 4 took part."""
    good = {"site-1": ([1e16, 1.0, 2.0], 10), "site-3": ([-1e16, 2.0, 0.5], 10), "site-4": ([3.0, 4.0, 1.0], 7)}
    nan = stream_update([np.nan, 0.0, 0.0], 10)
    outcomes = set()
    for arrival in itertools.permutations([*good, "site-2"]):
        core = streaming_core(sites=["site-1", "site-2", "site-3", "site-4", "site-5"])
        for site in arrival:
            reason = core.accept(site, *(nan if site == "site-2" else stream_update(*good[site])))
            assert (reason is not None) == (site == "site-2")
        assert "site-2" not in core.stream.total.weights and "site-2" not in core.stream.waiting
        result = core.aggregate()
        assert set(result.shares) == set(good) and "NaN" in core.rejected["site-2"]
        outcomes.add(result.params["w"].tobytes())
    alone = streaming_core(sites=list(good))
    for site in good:
        alone.accept(site, *stream_update(*good[site]))
    assert outcomes == {alone.aggregate().params["w"].tobytes()}


def test_without_the_site_list_every_result_waits_for_the_aggregation() -> None:
    core = streaming_core()  # nobody called expect_sites: no result may be added before an earlier site's
    assert core.awaits_site_list()
    for site in ("site-2", "site-1"):
        core.accept(site, *stream_update(*HAND[site]))
    assert sorted(core.stream.waiting) == ["site-1", "site-2"]
    assert list(core.aggregate().shares) == ["site-1", "site-2"]


@pytest.mark.parametrize("method, options, reason", [
    ("fedavg", {"robust": {"max_norm_ratio": 10}}, "update-norm bound"),
    ("fedavg", {"robust": {"max_share": 0.5}}, "share cap"),
    ("fedmas", {"method_args": {"aggregation": "mas_drw"}}, "method 'fedmas'"),
    ("fedmas", {"method_args": {"max_share": 0.4}}, "method 'fedmas'"),
])
def test_a_rule_that_needs_every_update_falls_back_to_one_batch_and_says_why(method, options, reason) -> None:
    core = streaming_core(method, sites=["site-1", "site-2"], **options)
    assert core.stream is None and not core.awaits_site_list()
    meta = {"n_samples": 10, "rf": 1.0} if method == "fedmas" else {"n_samples": 10}
    core.accept("site-1", stream_update([1.0, 2.0, 3.0], 10)[0], meta)
    core.accept("site-2", stream_update([2.0, 2.0, 3.0], 10)[0], meta)
    facts = core.aggregate().info["stream_aggregation"]
    assert facts["mode"] == "batch" and reason in facts["reason"]


@pytest.mark.parametrize("method, method_args", [("fedmas", {}), ("fedmas", {"aggregation": "samples"}),
                                                 ("bsm-fl", {}), ("fedprox", {})])
def test_linear_rules_stream(method: str, method_args: dict) -> None:
    core = streaming_core(method, sites=["site-1", "site-2"], method_args=method_args)
    assert core.stream is not None and core.stream_aggregation  # a linear rule sums results as they arrive
    meta = {"n_samples": 10, "rf": 1.0} if method == "fedmas" else {"n_samples": 10}
    core.accept("site-1", stream_update([1.0, 2.0, 3.0], 10)[0], meta)
    assert core.updates["site-1"].arrays == {}  # its model arrays went into the running sum, not the update
    core.accept("site-2", stream_update([3.0, 2.0, 3.0], 10)[0], meta)
    result = core.aggregate()
    assert result.info["stream_aggregation"]["mode"] == "streamed"
    np.testing.assert_allclose(result.params["w"], [2.0, 2.0, 3.0])


def test_the_flare_aggregator_learns_the_sites_from_flares_client_list() -> None:
    """In a FLARE job the sites are FLARE's registered clients, the train task's targets (the controller
    broadcasts to all of them)."""
    from types import SimpleNamespace

    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_constant import ReservedKey

    from medflare.flare.aggregator import MedflareAggregator

    aggregator = MedflareAggregator().use_plan(site_data_plan("fedavg", 3, rounds=2, stream_aggregation=True))
    assert aggregator.core.stream_aggregation is True
    aggregator.core.start_round(STREAM_GLOBAL, RoundContext(0, 2))  # as the controller starts a round
    aggregator.core.start_phase("train")
    clients = [SimpleNamespace(name=name) for name in ("site-1", "site-2", "site-3")]
    fl_ctx = SimpleNamespace(get_engine=lambda: SimpleNamespace(get_clients=lambda: clients))

    def result(site: str):
        arrays, meta = stream_update(*HAND[site])
        shareable = DXO(DataKind.WEIGHTS, data=arrays, meta=meta).to_shareable()
        shareable.set_peer_props({ReservedKey.IDENTITY_NAME: site})
        return shareable

    assert aggregator.accept(result("site-2"), fl_ctx) and aggregator.accept(result("site-1"), fl_ctx)
    assert aggregator.core.stream.expected == {"site-1", "site-2", "site-3"}
    assert not aggregator.core.stream.waiting  # site-2 waited only for site-1, not for the aggregation


def test_filter_history_carries_only_the_names_of_flares_result_filters(core: RoundAggregation) -> None:
    """Issue 60, item 8: ``filter_history`` took any 16 strings of 200 characters (a path, a patient's name) into
    the server's record; now only the class names FLARE's result filters write there. The reason names the
    position, never the text; the site's own privacy filter applies the same check before anything leaves."""
    from medflare.contracts import ContractContext, check_result_values
    from medflare.errors import PayloadError

    arrays, meta = update(1.0)
    free_text = {**meta, "filter_history": ["ExcludeVars", "MRN 0042 Jane Doe /data/scans"]}
    reason = core.accept("site-1", arrays, free_text)
    assert "'filter_history' may name only " in reason and "entries [1] are not" in reason and "Jane" not in reason
    with pytest.raises(PayloadError, match="entries \\[1\\] are not"):
        check_result_values(get_method("fedavg").payload, arrays, free_text, ContractContext(3), "train")
    assert core.accept("site-2", arrays, {**meta, "filter_history": ["ExcludeVars", "PercentilePrivacy"]}) is None
    assert core.updates["site-2"].meta["filter_history"] == ["ExcludeVars", "PercentilePrivacy"]
