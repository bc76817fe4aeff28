"""FedRS restricted softmax against hand-computed values (float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from medflare.errors import ConfigError, DataError
from medflare.losses import restricted_logits, restricted_softmax_loss, restriction_scales


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_hard_scales_restrict_only_the_missing_classes() -> None:
    assert restriction_scales([4, 0, 1, 0], alpha=0.3).tolist() == [1.0, 0.3, 1.0, 0.3]


def test_soft_scales_follow_the_authors_code() -> None:
    # alpha + (1 - alpha) * n / max n with n = (4, 0, 1): (1, .25, .25 + .75 * .25)
    assert restriction_scales([4, 0, 1], alpha=0.25, mode="soft").tolist() == pytest.approx([1.0, 0.25, 0.4375])


def test_a_label_set_mask_works_as_counts() -> None:
    assert restriction_scales(torch.tensor([True, False, True]), alpha=0.5).tolist() == [1.0, 0.5, 1.0]


def test_restricted_loss_by_hand() -> None:
    # z = (2, 1, -1), class 1 missing, alpha = .5 -> (2, .5, -1); true class 0.
    expected = -2.0 + math.log(math.exp(2.0) + math.exp(0.5) + math.exp(-1.0))
    loss = restricted_softmax_loss(_t([[2.0, 1.0, -1.0]]), torch.tensor([0]), [3, 0, 1], alpha=0.5)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_missing_class_gradient_is_scaled_by_alpha() -> None:
    logits = _t([[0.7, 0.2, -0.4]]).requires_grad_()
    restricted_softmax_loss(logits, torch.tensor([0]), [2, 0, 2], alpha=0.1).backward()
    scaled = _t([[0.7, 0.02, -0.4]])
    # d/dz_1 of CE(alpha * z_1) = alpha * softmax(scaled)_1
    assert logits.grad[0, 1].item() == pytest.approx(0.1 * torch.softmax(scaled, 1)[0, 1].item(), abs=1e-12)


def test_alpha_one_is_plain_cross_entropy() -> None:
    logits, targets = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    assert restricted_softmax_loss(logits, targets, [1, 0, 5], alpha=1.0).item() == pytest.approx(
        F.cross_entropy(logits, targets).item()
    )


def test_restricted_logits_leave_the_input_untouched() -> None:
    logits = _t([[1.0, 2.0]])
    assert restricted_logits(logits, [1, 0], alpha=0.0).tolist() == [[1.0, 0.0]]
    assert logits.tolist() == [[1.0, 2.0]]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"alpha": 1.5}, ConfigError, "alpha"),
    ({"alpha": 0.5, "mode": "medium"}, ConfigError, "mode"),
])
def test_bad_settings_are_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        restriction_scales([1, 2], **kwargs)


def test_all_zero_counts_and_wrong_width_are_refused() -> None:
    with pytest.raises(DataError, match="all zero"):
        restriction_scales([0, 0], alpha=0.5)
    with pytest.raises(DataError, match="3 classes"):
        restricted_logits(_t([[1.0, 2.0]]), [1, 1, 1], alpha=0.5)
