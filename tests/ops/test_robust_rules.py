"""ops/robust_rules.py against hand-computed cases of each paper's definition (issue 49, item 3)."""

from __future__ import annotations

import numpy as np
import pytest

from medflare.errors import ConfigError
from medflare.ops.influence import Weighting, bound
from medflare.ops.robust_rules import (
    bulyan,
    coordinate_median,
    krum,
    krum_scores,
    multi_krum,
    multi_krum_picks,
    robust_combiner,
    squared_distances,
    trimmed_mean,
    weighted_median,
    weighted_trimmed_mean,
)

# four honest sites near (1, 1) and one hostile far away
UPDATES = np.array([[1.0, 1.0], [1.2, 0.8], [0.9, 1.1], [1.1, 1.0], [100.0, -100.0]])


def test_median_and_trimmed_mean_per_coordinate() -> None:
    np.testing.assert_allclose(coordinate_median(UPDATES), [1.1, 1.0])
    # beta 0.2 of 5 sites cuts one largest and one smallest per coordinate: x {0.9, 1, 1.1, 1.2, 100} -> 1.1;
    # y {-100, 0.8, 1, 1, 1.1} -> (0.8 + 1 + 1) / 3
    np.testing.assert_allclose(trimmed_mean(UPDATES, 0.2), [1.1, 2.8 / 3])
    np.testing.assert_allclose(trimmed_mean(UPDATES, 0.0), UPDATES.mean(axis=0))
    with pytest.raises(ConfigError, match="trim_fraction must be in"):
        trimmed_mean(UPDATES, 0.5)


def test_krum_scores_sum_the_n_minus_f_minus_2_nearest_squared_distances() -> None:
    points = np.array([[0.0], [1.0], [3.0], [10.0]])
    # f = 1: n - f - 2 = 1 neighbour. 0 -> 1 (1); 1 -> 0 (1); 3 -> 1 (4); 10 -> 3 (49)
    np.testing.assert_allclose(krum_scores(points, 1), [1.0, 1.0, 4.0, 49.0])
    # f = 0: two neighbours. 0: 1 + 9; 1: 1 + 4; 3: 4 + 9; 10: 49 + 81
    np.testing.assert_allclose(krum_scores(points, 0), [10.0, 5.0, 13.0, 130.0])
    np.testing.assert_allclose(krum(points, 0), [1.0])
    with pytest.raises(ConfigError, match="n - f - 2 >= 1"):
        krum_scores(points, 2)


def test_krum_and_multi_krum_leave_the_hostile_update_out() -> None:
    assert krum(UPDATES, 1).tolist() in UPDATES[:4].tolist()
    kept = multi_krum(UPDATES, 1, 4)
    np.testing.assert_allclose(kept, UPDATES[:4].mean(axis=0))  # the four honest ones, averaged
    np.testing.assert_allclose(multi_krum(UPDATES, 1, 1), krum(UPDATES, 1))


def test_bulyan_needs_4f_plus_3_and_trims_around_the_median_of_its_krum_picks() -> None:
    seven = np.array([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0], [1000.0]])
    # f = 1, by hand: Krum picks (4 neighbours, then 3, 2, 1, 1) 3, 4, 2 (tie with 5: the first), 5, 1 (tie with 6);
    # theta = 5 picks, beta = 3 values closest to their median 3: {3, 2, 4}, mean 3
    assert bulyan(seven, 1).tolist() == [3.0]
    with pytest.raises(ConfigError, match="n >= 4f \\+ 3"):
        bulyan(seven[:6], 1)


# ----- weighted forms: how a rule composes with a method's shares ---------------------------------------------------
def test_the_weighted_median_passes_half_of_the_share_mass() -> None:
    values = np.array([[0.0], [1.0], [2.0], [10.0]])
    # cumulative shares in value order 0.1, 0.5, 0.8, 1.0: exactly one half at 1.0 -> mean of 1 and the next, 2
    np.testing.assert_allclose(weighted_median(values, np.array([0.1, 0.4, 0.3, 0.2])), [1.5])
    # 0.1, 0.2, 0.6: the value where the mass passes one half is 2
    np.testing.assert_allclose(weighted_median(values, np.array([0.1, 0.1, 0.4, 0.4])), [2.0])
    # a site with no share is skipped on both sides of the half: 0 (0.5), 1 (0), 2 (0.5) -> (0 + 2) / 2
    np.testing.assert_allclose(weighted_median(values[:3], np.array([0.5, 0.0, 0.5])), [1.0])


def test_the_weighted_trimmed_mean_cuts_share_mass_not_sites() -> None:
    values = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]])
    # beta 0.2: 0.2 of the mass cut from each end. Shares 0.1, 0.2, 0.2, 0.3, 0.2 in value order:
    # the low cut takes 0 (0.1) and half of 1's 0.2; the high cut takes 100 (0.2); kept 1 (0.1), 2 (0.2), 3 (0.3)
    shares = np.array([0.1, 0.2, 0.2, 0.3, 0.2])
    np.testing.assert_allclose(weighted_trimmed_mean(values, shares, 0.2), [(0.1 * 1 + 0.2 * 2 + 0.3 * 3) / 0.6])


def test_with_equal_shares_every_weighted_form_is_the_papers_rule() -> None:
    rng = np.random.default_rng(0)
    for count in (3, 4, 7, 8, 10):
        values = rng.normal(size=(count, 5, 3))
        equal = np.full(count, 1.0 / count)
        np.testing.assert_allclose(weighted_median(values, equal), np.median(values, axis=0))
        cut = int(0.25 * count)
        np.testing.assert_allclose(weighted_trimmed_mean(values, equal, cut / count),
                                   np.sort(values, axis=0)[cut: count - cut].mean(axis=0))


def test_row_shares_weigh_each_row_on_its_own() -> None:
    # a classifier [2 rows, 1 column], three sites; row 0 is mostly site-1's, row 1 mostly site-3's
    values = np.array([[[0.0], [0.0]], [[1.0], [1.0]], [[5.0], [5.0]]])
    rows = np.array([[0.6, 0.1], [0.3, 0.3], [0.1, 0.6]])  # [sites, rows]
    np.testing.assert_allclose(weighted_median(values, rows), [[0.0], [5.0]])


def test_the_combiner_applies_the_rule_to_every_array_with_its_bounded_shares() -> None:
    arrays = {"a": {"w": np.array([0.0, 0.0], np.float32), "n": np.array(3, np.int64)},
              "b": {"w": np.array([1.0, 1.0], np.float32), "n": np.array(4, np.int64)},
              "c": {"w": np.array([2.0, 9.0], np.float32), "n": np.array(9, np.int64)}}
    # the method wants site a at 0.98; the cap 0.4 leaves a 0.4, b 0.3, c 0.3: the median is b's
    shares = bound(Weighting({"a": 98.0, "b": 1.0, "c": 1.0}), cap=0.4)
    combined = robust_combiner(weighted_median)(arrays, shares, {"w": np.float32, "n": np.int64})
    np.testing.assert_array_equal(combined["w"], [1.0, 1.0])
    assert combined["w"].dtype == np.float32 and int(combined["n"]) == 4 and combined["n"].dtype == np.int64
    uncapped = robust_combiner(weighted_median)(arrays, bound(Weighting({"a": 98.0, "b": 1.0, "c": 1.0})))
    np.testing.assert_array_equal(uncapped["w"], [0.0, 0.0])


def test_krum_picks_from_distances_summed_key_by_key() -> None:
    models = [{"x": np.array([0.0]), "y": np.array([[0.0, 0.0]])}, {"x": np.array([1.0]), "y": np.array([[0.0, 1.0]])},
              {"x": np.array([0.0]), "y": np.array([[2.0, 0.0]])}, {"x": np.array([9.0]), "y": np.array([[9.0, 9.0]])}]
    distances = squared_distances(models)
    assert distances[0, 1] == 2.0 and distances[0, 2] == 4.0 and distances[1, 2] == 6.0
    assert distances[3, 0] == 81 + 162 and np.all(np.diag(distances) == 0)
    assert multi_krum_picks(distances, 1, 3) == [0, 1, 2]  # f = 1: one neighbour each; 3's nearest is 81 + 113 away
