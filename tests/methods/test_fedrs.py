"""FedRS: balanced softmax on restricted logits, by hand; prediction uses the raw logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medflare.errors import ConfigError
from medflare.methods.fedrs import FedRsConfig

from ._trainers import make_trainer
from .conftest import make_site


def test_loss_is_balanced_softmax_on_alpha_scaled_missing_logits(linear) -> None:
    site = make_site(n=6, labels=[0, 0, 2, 0, 2, 2])  # class 1 is missing at this site
    trainer = make_trainer("fedrs", linear, site, FedRsConfig(alpha=0.25))
    x, y = site.train.tensors
    z = linear(x)
    scaled = z * torch.tensor([1.0, 0.25, 1.0], dtype=torch.float64)
    prior = torch.log(torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64) + 1e-9)
    assert trainer.compute_loss(x, y).item() == pytest.approx(F.cross_entropy(scaled + prior, y).item(), abs=1e-12)
    assert torch.equal(trainer.predict_logits(x), z)


def test_ce_variant_is_the_published_fedrs(linear) -> None:
    site = make_site(n=6, labels=[0, 0, 2, 0, 2, 2])
    trainer = make_trainer("fedrs", linear, site, FedRsConfig(alpha=0.0, loss="ce"))
    x, y = site.train.tensors
    scaled = linear(x) * torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    assert trainer.compute_loss(x, y).item() == pytest.approx(F.cross_entropy(scaled, y).item(), abs=1e-12)


@pytest.mark.parametrize("field, value", [("alpha", -0.1), ("restriction", "x"), ("loss", "focal")])
def test_bad_config_is_refused(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        FedRsConfig(**{field: value})
