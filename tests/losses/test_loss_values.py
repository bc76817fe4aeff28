"""Each loss against a value computed by hand in the test (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medflare.errors import ConfigError, DataError, PayloadError
from medflare.losses import (
    LDAMLoss,
    balanced_softmax_loss,
    class_balanced_weights,
    drw_class_weights,
    focal_loss,
    kl_to_teacher,
    logit_calibrated_ce,
    proximal_term,
    symmetric_cross_entropy,
)


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ----- balanced softmax --------------------------------------------------------------------------------------------
def test_balanced_softmax_by_hand() -> None:
    # z = (1, 0, -1), counts (6, 3, 1) -> pi = (.6, .3, .1); true class 0.
    # CE(z + log pi, 0) = -(1 + log .6) + log(e^1 * .6 + e^0 * .3 + e^-1 * .1)
    expected = -(1 + math.log(0.6)) + math.log(math.e * 0.6 + 0.3 + 0.1 / math.e)
    loss = balanced_softmax_loss(_t([[1.0, 0.0, -1.0]]), torch.tensor([0]), [6, 3, 1], eps=0.0)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("as_type", [list, np.array, torch.tensor], ids=["list", "numpy", "tensor"])
def test_balanced_softmax_accepts_count_types(as_type) -> None:
    logits, targets = _t([[0.3, -0.2, 0.5], [1.0, 0.1, -0.4]]), torch.tensor([2, 0])
    expected = F.cross_entropy(logits + torch.log(_t([0.5, 0.25, 0.25]) + 1e-12), targets)
    assert balanced_softmax_loss(logits, targets, as_type([2, 1, 1])).item() == pytest.approx(expected.item())


def test_balanced_softmax_absent_class_gets_log_eps_and_no_push_down() -> None:
    logits = _t([[0.2, 0.4, -0.1]]).requires_grad_()
    loss = balanced_softmax_loss(logits, torch.tensor([0]), [4, 0, 4], eps=1e-12)
    offset = _t([math.log(0.5 + 1e-12), math.log(1e-12), math.log(0.5 + 1e-12)])
    assert loss.item() == pytest.approx(F.cross_entropy(logits + offset, torch.tensor([0])).item())
    loss.backward()
    assert abs(logits.grad[0, 1].item()) < 1e-10  # softmax mass of the unseen class is ~e^-27.6


def test_balanced_softmax_uniform_prior_is_cross_entropy() -> None:
    logits, targets = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0])
    assert balanced_softmax_loss(logits, targets, [7, 7, 7, 7]).item() == pytest.approx(
        F.cross_entropy(logits, targets).item()
    )


@pytest.mark.parametrize("counts", [[1, 2], [1, -1, 2], [0, 0, 0]], ids=["wrong_length", "negative", "all_zero"])
def test_balanced_softmax_rejects_bad_counts(counts) -> None:
    with pytest.raises(DataError):
        balanced_softmax_loss(torch.zeros(1, 3), torch.tensor([0]), counts)


# ----- FedProx -----------------------------------------------------------------------------------------------------
def _one_weight_one_bias(weight: float, bias: float) -> nn.Linear:
    layer = nn.Linear(1, 1).double()
    with torch.no_grad():
        layer.weight.fill_(weight)
        layer.bias.fill_(bias)
    return layer


def test_proximal_term_by_hand() -> None:
    model = _one_weight_one_bias(2.0, -1.0)
    global_params = {"weight": _t([[0.5]]), "bias": np.array([1.0])}
    # (mu / 2) * ((2 - 0.5)^2 + (-1 - 1)^2) = 0.1 * (2.25 + 4) = 0.625 for mu = 0.2
    term = proximal_term(model, global_params, mu=0.2)
    assert term.item() == pytest.approx(0.625)
    term.backward()
    assert model.weight.grad.item() == pytest.approx(0.2 * 1.5)  # mu * (w - w_g)
    assert model.bias.grad.item() == pytest.approx(0.2 * -2.0)


def test_proximal_term_skips_frozen_parameters() -> None:
    model = _one_weight_one_bias(2.0, -1.0)
    model.bias.requires_grad_(False)
    assert proximal_term(model, {"weight": _t([[0.0]])}, mu=1.0).item() == pytest.approx(2.0)


def test_proximal_term_rejects_missing_or_misshapen_global_params() -> None:
    model = _one_weight_one_bias(0.0, 0.0)
    with pytest.raises(PayloadError, match="bias"):
        proximal_term(model, {"weight": _t([[0.0]])}, mu=1.0)
    with pytest.raises(PayloadError, match="shape"):
        proximal_term(model, {"weight": _t([0.0, 0.0]), "bias": _t([0.0])}, mu=1.0)
    with pytest.raises(ConfigError):
        proximal_term(model, {"weight": _t([[0.0]]), "bias": _t([0.0])}, mu=-1.0)


# ----- symmetric cross-entropy -------------------------------------------------------------------------------------
def test_symmetric_cross_entropy_by_formula() -> None:
    logits, targets = _t([[2.0, 0.5, -1.0], [0.0, 0.3, 0.1]]), torch.tensor([0, 2])
    probs = torch.softmax(logits, dim=1)
    p_true = probs[torch.arange(2), targets]
    # No probability is below the 1e-7 clamp, so RCE = -log(1e-4) * (1 - p_y) exactly.
    reverse_ce = (-math.log(1e-4) * (1 - p_true)).mean()
    expected = 0.1 * F.cross_entropy(logits, targets) + 1.0 * reverse_ce
    assert symmetric_cross_entropy(logits, targets).item() == pytest.approx(expected.item())
    assert symmetric_cross_entropy(logits, targets, alpha=1.0, beta=0.0).item() == pytest.approx(
        F.cross_entropy(logits, targets).item()
    )


# ----- KL to teacher -----------------------------------------------------------------------------------------------
def test_kl_direction_is_teacher_to_student() -> None:
    student_logits = _t([[1.0, 0.0, -1.0], [0.2, 0.2, 0.6]])
    teacher = _t([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    student = torch.softmax(student_logits, dim=1)
    kl_teacher_student = (teacher * (teacher / student).log()).sum(dim=1).mean()
    kl_student_teacher = (student * (student / teacher).log()).sum(dim=1).mean()
    value = kl_to_teacher(student_logits, teacher).item()
    assert value == pytest.approx(kl_teacher_student.item())
    assert value != pytest.approx(kl_student_teacher.item())


def test_kl_zero_when_student_matches_and_temperature_divides_logits() -> None:
    logits = _t([[0.3, -0.7, 1.1]])
    assert kl_to_teacher(logits, torch.softmax(logits, dim=1)).item() == pytest.approx(0.0, abs=1e-12)
    teacher = _t([[0.2, 0.3, 0.5]])
    assert kl_to_teacher(logits, teacher, temperature=2.0).item() == pytest.approx(
        kl_to_teacher(logits / 2.0, teacher).item()
    )
    with pytest.raises(DataError):
        kl_to_teacher(logits, _t([[0.5, 0.5]]))


# ----- FedLC -------------------------------------------------------------------------------------------------------
def test_logit_calibration_by_hand() -> None:
    # counts (16, 1): n^-1/4 = (0.5, 1); tau = 0.5 -> subtract (0.25, 0.5)
    logits, targets = _t([[0.4, 0.1]]), torch.tensor([1])
    expected = -(0.1 - 0.5) + math.log(math.exp(0.4 - 0.25) + math.exp(0.1 - 0.5))
    assert logit_calibrated_ce(logits, targets, [16, 1], tau=0.5).item() == pytest.approx(expected)


def test_logit_calibration_floors_absent_classes() -> None:
    logits, targets = _t([[0.0, 0.0]]), torch.tensor([0])
    # count 0 -> 1e-8 -> (1e-8)^-1/4 = 100 -> margin tau * 100 = 50 on class 1
    expected = F.cross_entropy(logits - _t([0.5, 50.0]), targets)
    assert logit_calibrated_ce(logits, targets, [1, 0], tau=0.5).item() == pytest.approx(expected.item())


# ----- LDAM and class weights --------------------------------------------------------------------------------------
def test_ldam_by_hand() -> None:
    loss_fn = LDAMLoss([1, 16], max_margin=0.5, scale=30.0)
    # n^-1/4 = (1, 0.5), rescaled to max 0.5 -> margins (0.5, 0.25)
    torch.testing.assert_close(loss_fn.margins, torch.tensor([0.5, 0.25]))
    logits, targets = _t([[0.2, 0.1]]), torch.tensor([1])
    # s * (z - m_y onehot) = 30 * (0.2, 0.1 - 0.25) = (6, -4.5)
    expected = 4.5 + math.log(math.exp(6.0) + math.exp(-4.5))
    assert loss_fn(logits, targets).item() == pytest.approx(expected)


def test_ldam_absent_class_gets_no_margin_and_present_classes_are_rescaled_among_themselves() -> None:
    # Present counts 500, 100: n^-1/4 ratio (100/500)^(1/4) = 0.6687, so with max 0.5 the margins are
    # 0.5 * 0.6687 = 0.334 (class 0) and 0.5 (class 1, the rarest present class); the absent class gets 0.
    loss_fn = LDAMLoss([500, 100, 0], max_margin=0.5, scale=30.0)
    torch.testing.assert_close(loss_fn.margins, torch.tensor([0.5 * 0.2**0.25, 0.5, 0.0]))
    assert loss_fn.margins[0].item() == pytest.approx(0.334, abs=5e-4)
    # The loss of a class-0 sample uses margin 0.334: s * (z - m onehot) = 30 * (0.9 - 0.334, 0.2, 0.1)
    logits, targets = _t([[0.9, 0.2, 0.1]]), torch.tensor([0])
    z = [30 * (0.9 - 0.5 * 0.2**0.25), 30 * 0.2, 30 * 0.1]
    expected = -z[0] + math.log(sum(math.exp(v) for v in z))
    assert loss_fn(logits, targets).item() == pytest.approx(expected, rel=1e-5)


def test_ldam_site_without_labels_has_zero_margins() -> None:
    torch.testing.assert_close(LDAMLoss([0, 0, 0]).margins, torch.zeros(3))


def test_class_balanced_weights_by_hand() -> None:
    # beta = 0.5, counts (1, 2): (1 - b) / (1 - b^n) = (1, 2/3), normalised to sum 2 -> (1.2, 0.8)
    torch.testing.assert_close(class_balanced_weights([1, 2], beta=0.5), torch.tensor([1.2, 0.8]))
    torch.testing.assert_close(class_balanced_weights([5, 50, 500], beta=0.0), torch.ones(3))
    with pytest.raises(ConfigError):
        class_balanced_weights([1, 2], beta=1.0)


def test_drw_switches_on_at_eighty_percent() -> None:
    counts = [10, 1000]
    torch.testing.assert_close(drw_class_weights(counts, current_round=159, total_rounds=200), torch.ones(2))
    after = drw_class_weights(counts, current_round=160, total_rounds=200)
    torch.testing.assert_close(after, class_balanced_weights(counts))
    assert after[0] > after[1]


def test_drw_switches_at_the_exact_round_when_the_product_rounds_up() -> None:
    # 0.55 · 100 is 55.00000000000001 in floats: re-weighting is on from round ⌈55⌉ = 55, not 56.
    counts = [10, 1000]
    torch.testing.assert_close(drw_class_weights(counts, current_round=54, total_rounds=100, start_fraction=0.55),
                               torch.ones(2))
    assert drw_class_weights(counts, current_round=55, total_rounds=100, start_fraction=0.55)[0] > 1.0


# ----- focal -------------------------------------------------------------------------------------------------------
def test_focal_loss_by_hand() -> None:
    logits, targets = _t([[math.log(3.0), 0.0]]), torch.tensor([0])  # p = (0.75, 0.25)
    assert focal_loss(logits, targets, gamma=2.0).item() == pytest.approx(0.25**2 * -math.log(0.75))
    assert focal_loss(logits, targets, gamma=0.0).item() == pytest.approx(-math.log(0.75))
    weighted = focal_loss(logits, targets, gamma=2.0, class_weights=_t([2.0, 1.0]))
    assert weighted.item() == pytest.approx(2.0 * 0.25**2 * -math.log(0.75))
