"""LDAM-DRW-FL against hand-written float64 references: margins, the DRW switch round, the loss, the model."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medflare.errors import ConfigError
from medflare.methods.base import RoundContext
from medflare.methods.ldam_drw import SPEC, LdamDrwConfig  # importing the package registers 'ldam-drw'
from medflare.models import Classifier, CosineLinear

from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

# Counts 16 / 1 / 81 give n^-1/4 = 1/2, 1, 1/3; rescaled to a maximum of 0.5 the margins are 1/4, 1/2, 1/6.
LABELS = [0] * 16 + [1] + [2] * 81 + [-1] * 3  # three unlabelled samples, which the loss must ignore
HAND_MARGINS = np.array([0.25, 0.5, 1 / 6])


def hand_class_balanced(counts: list[int], beta: float = 0.9999) -> np.ndarray:
    """(1 − β) / (1 − β^n_k), normalised to sum K."""
    weights = np.array([(1 - beta) / (1 - beta**n) for n in counts])
    return weights * len(counts) / weights.sum()


def reference_loss(model: Classifier, x: torch.Tensor, y: torch.Tensor, class_weights: np.ndarray) -> torch.Tensor:
    """Σ w_y · −log softmax(30 · (cos − m_y onehot))_y / Σ w_y over labelled rows, written out in float64."""
    keep = y >= 0
    x, y = x[keep], y[keep]
    linear = model.backbone[0]
    features = torch.tanh(x @ linear.weight.T + linear.bias)
    rows = model.head.weight
    cosines = (features / features.norm(dim=1, keepdim=True)) @ (rows / rows.norm(dim=1, keepdim=True)).T
    z = 30.0 * (cosines - F.one_hot(y, 3) * torch.as_tensor(HAND_MARGINS)[y, None])
    nll = -(z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, dim=1))
    w = torch.as_tensor(class_weights)[y]
    return (w * nll).sum() / w.sum()


@pytest.fixture
def long_tail_site() -> SimpleNamespace:
    return make_site(n=len(LABELS), labels=LABELS)


def test_margins_follow_inverse_fourth_root_of_site_counts(long_tail_site) -> None:
    # Prepare
    trainer = make_trainer("ldam-drw", tiny_classifier(CosineLinear), long_tail_site)
    # Execute
    margins = trainer.ldam_loss.margins
    # Assert
    np.testing.assert_allclose(margins.numpy(), HAND_MARGINS, rtol=1e-6)


@pytest.mark.parametrize(("total_rounds", "first_reweighted_round"), [(10, 8), (200, 160), (7, 6)])
def test_drw_switches_on_at_eighty_percent_of_rounds(
    long_tail_site: SimpleNamespace, total_rounds: int, first_reweighted_round: int
) -> None:
    # Prepare
    trainer = make_trainer("ldam-drw", tiny_classifier(CosineLinear), long_tail_site)
    # Execute
    trainer.on_round_start(RoundContext(first_reweighted_round - 1, total_rounds))
    before = trainer.class_weights.clone()
    trainer.on_round_start(RoundContext(first_reweighted_round, total_rounds))
    after = trainer.class_weights
    # Assert
    np.testing.assert_array_equal(before.numpy(), np.ones(3))
    np.testing.assert_allclose(after.numpy(), hand_class_balanced([16, 1, 81]), rtol=1e-6)
    assert after[1] > after[0] > after[2]  # rarest class weighs most


@pytest.mark.parametrize("current_round", [7, 8])  # of 10: last uniform round, first re-weighted round
def test_loss_matches_reference_before_and_after_drw(long_tail_site, current_round: int) -> None:
    # Prepare
    model = tiny_classifier(CosineLinear)
    trainer = make_trainer("ldam-drw", model, long_tail_site)
    x, y = long_tail_site.train.tensors
    weights = hand_class_balanced([16, 1, 81]) if current_round >= 8 else np.ones(3)
    # Execute
    trainer.on_round_start(RoundContext(current_round, 10))
    loss = trainer.compute_loss(x, y)
    # Assert
    torch.testing.assert_close(loss.double(), reference_loss(model, x, y, weights), rtol=1e-5, atol=1e-6)


def test_build_model_swaps_in_a_cosine_head_under_the_same_key() -> None:
    # Prepare
    torch.manual_seed(0)
    # Execute
    model = SPEC.build_model("cnn", 3, 1, 28, None, LdamDrwConfig())
    outputs = model(torch.randn(2, 1, 28, 28))
    # Assert
    assert isinstance(model.head, CosineLinear)
    assert [k for k in model.state_dict() if k.startswith("head.")] == ["head.weight"]
    assert outputs.shape == (2, 3) and bool((outputs.abs() <= 1 + 1e-6).all())


def test_evaluation_scores_scaled_cosines(site) -> None:
    # Prepare
    model = tiny_classifier(CosineLinear)
    trainer = make_trainer("ldam-drw", model, site)
    x, _ = site.train.tensors
    # Execute
    logits = trainer.predict_logits(x)
    # Assert
    torch.testing.assert_close(logits, 30.0 * model(x))


def test_one_round_smoke_with_drw_on(long_tail_site) -> None:
    # Prepare
    model = tiny_classifier(CosineLinear)
    trainer = make_trainer("ldam-drw", model, long_tail_site)
    before = model.head.weight.detach().clone()
    # Execute
    meta = trainer.train_round(RoundContext(4, 5))
    # Assert
    assert meta["n_samples"] == 98 and math.isfinite(meta["train_loss"])
    assert not torch.equal(model.head.weight.detach(), before)
    assert set(trainer.outgoing_arrays()) == set(model.state_dict())


def test_site_lacking_a_class_gets_margin_zero_for_it_and_trains() -> None:
    # Prepare: counts 16 / 0 / 81; present n^-1/4 = 1/2, 1/3, rescaled to max 0.5 -> 0.5, 1/3; absent -> 0
    site = make_site(n=97, labels=[0] * 16 + [2] * 81)
    model = tiny_classifier(CosineLinear)
    trainer = make_trainer("ldam-drw", model, site)
    before = model.head.weight.detach().clone()
    # Execute
    meta = trainer.train_round(RoundContext(9, 10))  # DRW on
    # Assert
    np.testing.assert_allclose(trainer.ldam_loss.margins.numpy(), [0.5, 0.0, 1 / 3], rtol=1e-6)
    assert meta["n_samples"] == 97 and math.isfinite(meta["train_loss"])
    assert not torch.equal(model.head.weight.detach(), before)


@pytest.mark.parametrize(
    "bad", [{"max_margin": 0.0}, {"scale": -1.0}, {"drw_beta": 1.0}, {"drw_start_fraction": 1.5}]
)
def test_config_rejects_out_of_range_values(bad: dict) -> None:
    with pytest.raises(ConfigError):
        LdamDrwConfig(**bad)
