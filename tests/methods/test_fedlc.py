"""FedLC against hand-computed float64 references: CE on explicitly calibrated logits, site-local counts."""

import math
from types import SimpleNamespace

import pytest
import torch

from medflare.errors import ConfigError
from medflare.methods.base import RoundContext
from medflare.methods.fedlc import FedLcConfig  # importing the package registers 'fedlc'

from ._trainers import make_trainer
from .conftest import make_site

# Counts 16 / 1 / 81 give n^-1/4 = 1/2, 1, 1/3, so tau = 0.5 subtracts 1/4, 1/2, 1/6: the rarest class the most.
LABELS = [0] * 16 + [1] + [2] * 81 + [-1] * 3  # three unlabelled samples, which the loss must ignore


@pytest.fixture
def long_tail_site() -> SimpleNamespace:
    return make_site(n=len(LABELS), labels=LABELS)


def constant_logit_model(logits: list[float]) -> torch.nn.Linear:
    """A linear model whose output is ``logits`` for every input (zero weight, bias = logits)."""
    model = torch.nn.Linear(4, len(logits)).double()
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor(logits, dtype=torch.float64))
    return model


def test_loss_by_hand_for_the_rarest_class(long_tail_site) -> None:
    # Prepare: raw logits (0.4, 0.1, 0.0) for everyone; look at one sample of the rare class 1.
    trainer = make_trainer("fedlc", constant_logit_model([0.4, 0.1, 0.0]), long_tail_site)
    x, y = torch.zeros(1, 4, dtype=torch.float64), torch.tensor([1])
    # calibrated logits = (0.4 − 1/4, 0.1 − 1/2, 0 − 1/6)
    expected = -(0.1 - 0.5) + math.log(math.exp(0.15) + math.exp(-0.4) + math.exp(-1 / 6))
    plain_ce = -0.1 + math.log(math.exp(0.4) + math.exp(0.1) + 1.0)
    # Execute
    loss = trainer.compute_loss(x, y).item()
    # Assert: calibration makes the rare class harder to fit, i.e. demands a larger raw margin for it.
    assert loss == pytest.approx(expected, rel=1e-12)
    assert loss > plain_ce


@pytest.mark.parametrize("tau", [0.5, 0.0, 2.0])
def test_loss_is_ce_on_explicitly_calibrated_logits(long_tail_site, linear, tau: float) -> None:
    # Prepare
    trainer = make_trainer("fedlc", linear, long_tail_site, FedLcConfig(tau=tau))
    x, y = long_tail_site.train.tensors
    keep = y >= 0
    calibrated = linear(x[keep]) - tau * torch.tensor([16.0, 1.0, 81.0], dtype=torch.float64).pow(-0.25)
    expected = -(calibrated.gather(1, y[keep, None]).squeeze(1) - torch.logsumexp(calibrated, dim=1)).mean()
    # Execute
    loss = trainer.compute_loss(x, y)
    # Assert
    torch.testing.assert_close(loss, expected)


def test_one_round_smoke(long_tail_site, linear) -> None:
    # Prepare
    trainer = make_trainer("fedlc", linear, long_tail_site)
    before = linear.weight.detach().clone()
    # Execute
    meta = trainer.train_round(RoundContext(0, 1))
    # Assert
    assert meta["n_samples"] == 98 and math.isfinite(meta["train_loss"])
    assert not torch.equal(linear.weight.detach(), before)
    assert set(trainer.outgoing_arrays()) == set(linear.state_dict())


def test_config_rejects_negative_tau() -> None:
    with pytest.raises(ConfigError):
        FedLcConfig(tau=-0.1)
