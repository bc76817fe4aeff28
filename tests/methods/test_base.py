"""methods/base.py: the site policy's floor on the statistics a site sends (issue 48, item 5)."""

from __future__ import annotations

import numpy as np

from medflare.methods.base import eval_stats, small_classes


def test_only_classes_a_site_has_some_but_fewer_than_the_minimum_of_are_hidden() -> None:
    np.testing.assert_array_equal(small_classes(np.array([0, 1, 4, 5]), 5), [False, True, True, False])
    assert not small_classes(np.array([1, 2]), 0).any()  # no floor


def test_a_class_below_the_minimum_leaves_no_trace_in_the_evaluation_statistics() -> None:
    labels = np.array([0, 0, 0, 1, 2, 2, 2])  # class 1: one image
    probs = np.array([[0.8, 0.1, 0.1]] * 3 + [[0.2, 0.7, 0.1]] + [[0.1, 0.1, 0.8]] * 3)
    losses = np.arange(7, dtype=float)
    full = eval_stats(labels, probs, losses, 3)
    floored = eval_stats(labels, probs, losses, 3, min_class_samples=2)
    assert full.confusion[1, 1] == 1 and full.count == 7
    # by hand: the class-1 image is gone from its row, from every other class's negative scores, count and loss
    np.testing.assert_array_equal(floored.confusion, [[3, 0, 0], [0, 0, 0], [0, 0, 3]])
    assert floored.count == 6 and floored.loss_sum == 21.0 - 3.0
    assert floored.pos_hist[1].sum() == 0 and floored.neg_hist.sum(axis=1).tolist() == [3, 6, 3]
    # the floor counts within the rows a statistic describes (an attribute group, say)
    group = eval_stats(labels, probs, losses, 3, keep=np.array([1, 1, 0, 0, 1, 1, 1], bool), min_class_samples=3)
    np.testing.assert_array_equal(group.confusion, [[0, 0, 0], [0, 0, 0], [0, 0, 3]])


def test_a_finding_with_too_few_positives_or_negatives_is_left_out_of_multi_label_statistics() -> None:
    labels = np.array([[1, 0, 1], [1, 0, 1], [0, -1, 1], [0, 1, 1]])  # finding 1: 1 positive; finding 2: 0 negatives
    probs = np.full((4, 3), 0.6)
    floored = eval_stats(labels, probs, np.zeros(4), 3, min_class_samples=2)
    assert floored.confusion[0].sum() == 4 and floored.confusion[1].sum() == 0  # 1 positive < 2: hidden
    assert floored.confusion[2].sum() == 4  # 4 positives, no negatives: a class it has none of, nothing to hide
    assert floored.count == 4 and floored.pos_hist[1].sum() == floored.neg_hist[1].sum() == 0
