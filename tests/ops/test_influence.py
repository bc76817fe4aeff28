"""The one choke point for influence: raw weights in, bounded shares out, whatever rule produced them."""

import numpy as np
import pytest

from medflare.errors import PayloadError
from medflare.ops.influence import Mixture, Weighting, bound, cap_vector, cast_like, combine, mix


def test_cap_vector_water_fills_a_hand_computed_case() -> None:
    # 0.7 -> 0.5; the excess 0.2 goes to 0.2 and 0.1 in proportion 2:1
    assert cap_vector(np.array([0.7, 0.2, 0.1]), 0.5) == pytest.approx([0.5, 0.2 + 0.2 * 2 / 3, 0.1 + 0.2 / 3])
    assert cap_vector(np.array([0.8, 0.1, 0.1]), 0.3) == pytest.approx([1 / 3] * 3)  # infeasible: equal shares
    assert cap_vector(np.array([1.0, 0.0, 0.0]), 0.6) == pytest.approx([0.6, 0.2, 0.2])  # no weight: equal excess
    assert cap_vector(np.array([0.7, 0.3]), 0.0) == pytest.approx([0.7, 0.3])  # off


def test_the_cap_holds_on_every_row_not_only_the_scalar_share() -> None:
    """The FedAvg* probe: n = 1e8 with every class marked capped the scalar share, but the head rows weighed
    n_k · mask unbounded, so the global head was the attacker's to 3e-7."""
    weights = {"a": 1e8, "b": 100.0, "c": 100.0}
    rows = {"head": {site: w * np.ones(3) for site, w in weights.items()}}
    shares = bound(Weighting(weights, rows), cap=0.6)
    assert shares.sites["a"] == pytest.approx(0.6)
    assert shares.rows["head"][0] == pytest.approx([0.6, 0.6, 0.6])
    assert shares.rows["head"].sum(axis=0) == pytest.approx([1.0, 1.0, 1.0])
    assert max(shares.largest().values()) <= 0.6 + 1e-12
    values = {"a": 10.0, "b": 0.0, "c": 0.0}
    updates = {site: {"head": np.full((3, 2), value, np.float32)} for site, value in values.items()}
    assert combine(updates, shares)["head"] == pytest.approx(np.full((3, 2), 6.0))


def test_a_row_nobody_weighs_falls_back_to_the_scalar_shares() -> None:
    rows = {"head": {"a": np.array([1.0, 0.0]), "b": np.array([3.0, 0.0])}}
    shares = bound(Weighting({"a": 1.0, "b": 1.0}, rows))
    np.testing.assert_allclose(shares.rows["head"], [[0.25, 0.5], [0.75, 0.5]])


@pytest.mark.parametrize("bad", [np.inf, np.nan, -1.0])
def test_non_finite_or_negative_row_weights_are_refused(bad: float) -> None:
    rows = {"head": {"a": np.array([1.0, bad]), "b": np.array([1.0, 1.0])}}
    with pytest.raises(PayloadError, match="row weights"):
        bound(Weighting({"a": 1.0, "b": 1.0}, rows))


def test_row_weights_that_overflow_their_sum_are_refused() -> None:
    rows = {"head": {"a": np.array([1e308, 1.0]), "b": np.array([1e308, 1.0])}}
    with pytest.raises(PayloadError, match="overflow"):
        bound(Weighting({"a": 1.0, "b": 1.0}, rows))


def test_the_rules_own_cap_and_the_jobs_cap_the_tighter_wins() -> None:
    weights = {"a": 8.0, "b": 1.0, "c": 1.0}
    assert bound(Weighting(weights, cap=0.5), cap=0.7).sites["a"] == pytest.approx(0.5)
    assert bound(Weighting(weights, cap=0.7), cap=0.5).sites["a"] == pytest.approx(0.5)
    assert bound(Weighting(weights), cap=0.0).sites["a"] == pytest.approx(0.8)


def test_a_mixture_keeps_each_receivers_total_and_caps_each_source() -> None:
    sources = {s: np.full((2, 2), v) for s, v in (("a", 1.0), ("b", 0.0), ("c", 0.0))}
    weights = {"c": {"a": 0.9, "b": 0.1}, "b": {"a": 0.5, "c": 0.5}, "a": {}}
    mixed = mix(Mixture("t", sources, weights), cap=0.6)
    assert mixed["a"] == {}  # nobody to learn from: no array
    # receiver c: total 1.0, a's share 0.9 capped to 0.6: 0.6·1 + 0.4·0
    np.testing.assert_allclose(mixed["c"]["t"], np.full((2, 2), 0.6))
    np.testing.assert_allclose(mix(Mixture("t", sources, weights))["c"]["t"], np.full((2, 2), 0.9))
    np.testing.assert_allclose(mixed["b"]["t"], np.full((2, 2), 0.5))


def test_integer_averages_never_wrap_around() -> None:
    """The probe: num_batches_tracked = 2^63 − 1 at two sites averaged to −2^63."""
    big = np.array([2**63 - 1], dtype=np.int64)
    averaged = combine({"a": {"n": big}, "b": {"n": big}}, bound(Weighting({"a": 1.0, "b": 1.0})))["n"]
    assert averaged[0] > 0 and averaged.dtype == np.int64
    assert cast_like(np.array([-1e30]), np.dtype(np.int64))[0] == np.iinfo(np.int64).min
    assert cast_like(np.array([2.6]), np.dtype(np.int64))[0] == 3
