"""ops/robust_rules.py against hand-computed cases of each paper's definition (issue 49, item 3)."""

from __future__ import annotations

import numpy as np
import pytest

from medflare.errors import ConfigError
from medflare.ops.robust_rules import bulyan, coordinate_median, krum, krum_scores, multi_krum, trimmed_mean

# four honest sites near (1, 1) and one hostile far away
UPDATES = np.array([[1.0, 1.0], [1.2, 0.8], [0.9, 1.1], [1.1, 1.0], [100.0, -100.0]])


def test_median_and_trimmed_mean_per_coordinate() -> None:
    np.testing.assert_allclose(coordinate_median(UPDATES), [1.1, 1.0])
    # beta 0.2 of 5 sites cuts one largest and one smallest per coordinate: x {0.9, 1, 1.1, 1.2, 100} -> 1.1;
    # y {-100, 0.8, 1, 1, 1.1} -> (0.8 + 1 + 1) / 3
    np.testing.assert_allclose(trimmed_mean(UPDATES, 0.2), [1.1, 2.8 / 3])
    np.testing.assert_allclose(trimmed_mean(UPDATES, 0.0), UPDATES.mean(axis=0))
    with pytest.raises(ConfigError, match="beta must be in"):
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
