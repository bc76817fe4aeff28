"""EvalStats: summable across sites and batches, and validated when received."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from medflare.errors import DataError, PayloadError
from medflare.metrics import EvalStats, binned_auc, score_bins


def _predictions(n: int = 200, num_classes: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(num_classes), size=n)
    return rng.integers(0, num_classes, size=n), probs


def _assert_equal(a: EvalStats, b: EvalStats) -> None:
    np.testing.assert_array_equal(a.confusion, b.confusion)
    np.testing.assert_array_equal(a.pos_hist, b.pos_hist)
    np.testing.assert_array_equal(a.neg_hist, b.neg_hist)
    assert a.count == b.count and a.loss_sum == pytest.approx(b.loss_sum)


def test_halves_sum_to_whole() -> None:
    y_true, probs = _predictions()
    whole = EvalStats.from_predictions(y_true, probs, 4, loss_sum=3.0)
    first = EvalStats.from_predictions(y_true[:70], probs[:70], 4, loss_sum=1.0)
    second = EvalStats.from_predictions(y_true[70:], probs[70:], 4, loss_sum=2.0)
    _assert_equal(first + second, whole)
    _assert_equal(sum([first, second]), whole)
    _assert_equal(EvalStats.zeros(4) + whole, whole)


def test_histograms_and_confusion_by_hand() -> None:
    # u(p) = p/2 + (logit p + 110)/300, bin = floor(10 u):
    # 0.8 -> 0.4 + 111.386/300 = 0.771 (bin 7); 0.2 -> 0.1 + 108.614/300 = 0.462 (4);
    # 0.45 -> 0.225 + 109.799/300 = 0.591 (5); 0.55 -> 0.275 + 110.201/300 = 0.642 (6)
    stats = EvalStats.from_predictions([0, 1], np.array([[0.8, 0.2], [0.45, 0.55]]), 2, bins=10)
    np.testing.assert_array_equal(stats.confusion, [[1, 0], [0, 1]])
    assert stats.pos_hist[0].nonzero()[0].tolist() == [7] and stats.pos_hist[1].nonzero()[0].tolist() == [6]
    assert stats.neg_hist[0].nonzero()[0].tolist() == [5] and stats.neg_hist[1].nonzero()[0].tolist() == [4]
    assert binned_auc(stats.pos_hist[0], stats.neg_hist[0]) == 1.0


def test_saturated_scores_keep_separate_bins() -> None:
    # logit(1e-30) = -69.1 and logit(1e-20) = -46.1: u = 40.9/300 = 0.136 and 63.9/300 = 0.213 (bins 136, 213).
    # 1 - 1e-6 and 1 - 1e-7: logit 13.8 and 16.1, u = 0.5 + 123.8/300 = 0.913 and 0.920 (bins 912, 920).
    scores = np.array([1e-30, 1e-20, 1 - 1e-6, 1 - 1e-7, 0.0, 1.0])
    assert score_bins(scores, 1000).tolist() == [136, 213, 912, 920, 0, 999]


def test_score_one_falls_in_last_bin_and_torch_input_is_accepted() -> None:
    stats = EvalStats.from_predictions(torch.tensor([1]), torch.tensor([[0.0, 1.0]]), 2, bins=10)
    assert stats.pos_hist[1, 9] == 1 and stats.neg_hist[0, 0] == 1


def test_dict_round_trip_is_json_serialisable() -> None:
    y_true, probs = _predictions()
    stats = EvalStats.from_predictions(y_true, probs, 4, loss_sum=12.5)
    payload = json.loads(json.dumps(stats.to_dict()))
    _assert_equal(EvalStats.from_dict(payload, num_classes=4, bins=1000), stats)


def _valid_payload() -> dict:
    y_true, probs = _predictions(n=20, num_classes=3)
    return EvalStats.from_predictions(y_true, probs, 3, bins=10).to_dict()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d.pop("neg_hist"),
        lambda d: d.update(confusion=[row[:2] for row in d["confusion"]]),
        lambda d: d.update(pos_hist=d["pos_hist"][:2]),
        lambda d: d.update(neg_hist=[row[:5] for row in d["neg_hist"]]),
        lambda d: d["confusion"][0].__setitem__(0, -1),
        lambda d: d.update(confusion=np.asarray(d["confusion"], dtype=float).tolist()),
        lambda d: d.update(count=d["count"] + 1),
        lambda d: d.update(count=-1),
        lambda d: d.update(count=True),
        lambda d: d.update(loss_sum=float("nan")),
        lambda d: d["pos_hist"][0].__setitem__(0, d["pos_hist"][0][0] + 1),
        lambda d: d.update(confusion=[[1, 2], [3]]),
    ],
    ids=[
        "missing_field",
        "non_square_confusion",
        "hist_rows_not_K",
        "neg_hist_other_bins",
        "negative_count",
        "float_counts",
        "count_disagrees",
        "negative_total",
        "bool_total",
        "nan_loss",
        "pos_hist_total_disagrees",
        "ragged",
    ],
)
def test_from_dict_rejects_bad_payloads(corrupt) -> None:
    payload = _valid_payload()
    corrupt(payload)
    with pytest.raises(PayloadError):
        EvalStats.from_dict(payload)


def test_unsigned_counts_beyond_any_site_are_refused_before_they_wrap() -> None:
    """An unsigned 2^64 - 1 passed the "no negative counts" check and became -1 in the int64 cast (issue 49, item 5);
    any count above contracts.MAX_SAMPLES is a forged statistic."""
    payload = _valid_payload()
    confusion = np.asarray(payload["confusion"], dtype=np.uint64)
    confusion[0, 0] = np.iinfo(np.uint64).max
    with pytest.raises(PayloadError, match="counts more than 100,000,000 samples in one cell"):
        EvalStats.from_dict({**payload, "confusion": confusion})
    with pytest.raises(PayloadError, match=r"'count' must be an integer in \[0, 100,000,000\]"):
        EvalStats.from_dict({**payload, "count": 10**12})


def test_from_dict_checks_expected_sizes() -> None:
    with pytest.raises(PayloadError, match="expected 5"):
        EvalStats.from_dict(_valid_payload(), num_classes=5)
    with pytest.raises(PayloadError, match="bins"):
        EvalStats.from_dict(_valid_payload(), bins=1000)
    with pytest.raises(PayloadError):
        EvalStats.from_dict([1, 2, 3])


@pytest.mark.parametrize(
    ("y_true", "probs"),
    [
        ([0, 1], np.array([[2.5, -1.0], [0.0, 1.0]])),  # logits, not probabilities
        ([0, 2], np.array([[0.5, 0.5], [0.5, 0.5]])),  # label out of range
        ([0], np.array([[0.5, 0.5], [0.5, 0.5]])),  # N mismatch
        ([0, 1], np.array([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])),  # K mismatch
    ],
    ids=["logits", "label_range", "n_mismatch", "k_mismatch"],
)
def test_from_predictions_rejects_bad_input(y_true, probs) -> None:
    with pytest.raises(DataError):
        EvalStats.from_predictions(y_true, probs, 2)


def test_adding_different_sizes_is_rejected() -> None:
    with pytest.raises(DataError):
        EvalStats.zeros(3) + EvalStats.zeros(4)
    with pytest.raises(DataError):
        EvalStats.zeros(3, bins=10) + EvalStats.zeros(3, bins=20)
