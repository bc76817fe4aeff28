"""The running weighted sum and its site order (``stream_aggregation``): hand-computed values, bit-for-bit
repeats whatever the arrival order, and what the server holds meanwhile."""

import gc
import itertools
import weakref

import numpy as np
import pytest

from medflare.errors import PayloadError
from medflare.ops import weighted_average
from medflare.ops.aggregate import RunningWeightedSum, SiteOrderedSum

SITES = ("site-1", "site-2", "site-3", "site-4")
# Float64 addition is not associative with these: (1e16 + 1) - 1e16 = 0 but (1e16 - 1e16) + 1 = 1. Weighted by
# the counts below, the sum of the four terms depends on the order they are added in (shown by
# test_these_values_make_the_sum_depend_on_the_order), so only a fixed order repeats bit for bit.
ORDER_SENSITIVE = {"site-1": 1e16, "site-2": 1.0, "site-3": -1e16, "site-4": 3.0}
COUNTS = {"site-1": 10.0, "site-2": 7.0, "site-3": 10.0, "site-4": 5.0}
DTYPES = {"w": np.dtype(np.float64)}


def arrays(site: str) -> dict[str, np.ndarray]:
    return {"w": np.full(3, ORDER_SENSITIVE[site], np.float64)}


def ordered_average(arrival: tuple[str, ...], expected: tuple[str, ...] | None = SITES) -> np.ndarray:
    stream = SiteOrderedSum()
    if expected is not None:
        stream.expect(expected)
    for site in arrival:
        stream.arrive(site, arrays(site), COUNTS[site])
    return stream.finish().average(DTYPES)["w"]


def test_the_running_sum_is_the_weighted_sum_over_the_weights_computed_by_hand() -> None:
    total = RunningWeightedSum()
    total.add("a", {"w": np.array([1.0, 2.0], np.float32), "n": np.array(4, np.int64)}, 1.0)
    total.add("b", {"w": np.array([3.0, -2.0], np.float32), "n": np.array(6, np.int64)}, 2.0)
    total.add("c", {"w": np.array([0.5, 8.0], np.float32), "n": np.array(9, np.int64)}, 5.0)
    # w: (1*1 + 2*3 + 5*0.5) / 8 = 9.5 / 8 ; (1*2 + 2*(-2) + 5*8) / 8 = 38 / 8 ; n: (4 + 12 + 45) / 8 = 7.625 -> 8
    result = total.average({"w": np.dtype(np.float64), "n": np.dtype(np.int64)})
    np.testing.assert_array_equal(result["w"], [9.5 / 8, 38 / 8])
    assert result["n"].dtype == np.int64 and int(result["n"]) == 8
    assert {k: v.dtype for k, v in total.sums.items()} == {"w": np.float64, "n": np.float64}
    batch = weighted_average({s: {"w": a} for s, a in (("a", [1.0, 2.0]), ("b", [3.0, -2.0]), ("c", [0.5, 8.0]))},
                             {"a": 1.0, "b": 2.0, "c": 5.0}, dtypes={"w": np.dtype(np.float64)})
    np.testing.assert_allclose(result["w"], batch["w"], rtol=1e-12, atol=0)


def test_these_values_make_the_sum_depend_on_the_order() -> None:
    """The control for the next test: added in arrival order, two arrivals give two different averages."""
    averages = set()
    for arrival in itertools.permutations(SITES):
        total = RunningWeightedSum()
        for site in arrival:
            total.add(site, arrays(site), COUNTS[site])
        averages.add(total.average(DTYPES)["w"].tobytes())
    assert len(averages) > 1


def test_every_arrival_order_gives_the_same_bits() -> None:
    """Fails when results are added as they arrive instead of in site order (checked by hand: with
    ``SiteOrderedSum.arrive`` adding at once, 24 arrivals gave several different averages)."""
    reference = ordered_average(SITES)
    for arrival in itertools.permutations(SITES):
        average = ordered_average(arrival)
        assert np.array_equal(average, reference) and average.tobytes() == reference.tobytes(), arrival
    assert ordered_average(SITES[::-1], expected=None).tobytes() == reference.tobytes()  # sites not named: all wait


def test_a_result_waits_only_for_the_sites_before_it_and_is_freed_once_added() -> None:
    stream = SiteOrderedSum()
    stream.expect(SITES)
    held = {site: arrays(site) for site in SITES}
    refs = {site: weakref.ref(held[site]["w"]) for site in SITES}
    for site in ("site-4", "site-3", "site-2"):
        stream.arrive(site, held.pop(site), COUNTS[site])
    assert sorted(stream.waiting) == ["site-2", "site-3", "site-4"] and not stream.total.weights
    stream.arrive("site-1", held.pop("site-1"), COUNTS["site-1"])
    gc.collect()
    assert not stream.waiting and list(stream.total.weights) == list(SITES)
    assert all(ref() is None for ref in refs.values())  # nothing but the float64 sum is left of them
    assert stream.most_waiting == 3


def test_in_site_order_nothing_waits() -> None:
    stream = SiteOrderedSum()
    stream.expect(SITES)
    for site in SITES:
        stream.arrive(site, arrays(site), COUNTS[site])
        assert not stream.waiting
    assert stream.most_waiting == 0


def test_an_absent_site_stops_blocking_and_one_that_never_answers_is_skipped_at_the_end() -> None:
    stream = SiteOrderedSum()
    stream.expect(SITES)
    stream.arrive("site-3", arrays("site-3"), COUNTS["site-3"])
    stream.arrive("site-2", arrays("site-2"), COUNTS["site-2"])
    assert sorted(stream.waiting) == ["site-2", "site-3"]
    stream.mark_absent("site-1")  # rejected: site-2 and site-3 are next in order
    assert not stream.waiting and list(stream.total.weights) == ["site-2", "site-3"]
    stream.arrive("site-4", arrays("site-4"), COUNTS["site-4"])
    assert list(stream.finish().weights) == ["site-2", "site-3", "site-4"]


def test_an_invalid_weight_is_refused_before_anything_is_held() -> None:
    stream = SiteOrderedSum()
    stream.expect(SITES)
    for weight in (float("nan"), -1.0, float("inf")):
        with pytest.raises(PayloadError, match="finite and >= 0"):
            stream.arrive("site-2", arrays("site-2"), weight)
    assert not stream.waiting and not stream.total.weights


def test_a_site_that_was_not_expected_and_comes_after_its_turn_is_added_and_reported() -> None:
    stream = SiteOrderedSum()
    stream.expect(["site-1", "site-3"])
    stream.arrive("site-3", arrays("site-3"), 1.0)
    stream.arrive("site-1", arrays("site-1"), 1.0)
    stream.arrive("site-2", arrays("site-2"), 1.0)  # not a target, and site-3 is already in the sum
    assert stream.out_of_order == ["site-2"] and list(stream.finish().weights) == ["site-1", "site-3", "site-2"]
    early = SiteOrderedSum()
    early.expect(["site-2"])
    early.arrive("site-1", arrays("site-1"), 1.0)  # not named, but its turn has not passed: it simply joins
    assert early.out_of_order == [] and list(early.total.weights) == ["site-1"]


def test_nothing_added_is_an_error() -> None:
    with pytest.raises(PayloadError, match="no site update"):
        SiteOrderedSum().finish().average(DTYPES)
