"""FedRS: balanced softmax on restricted logits, by hand; prediction uses the raw logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medflare.errors import ConfigError
from medflare.methods.bsm_fl import BsmFlConfig
from medflare.methods.fedrs import FedRsConfig

from ._trainers import make_trainer
from .conftest import make_site


def test_loss_is_balanced_softmax_on_alpha_scaled_missing_logits(linear) -> None:
    site = make_site(n=6, labels=[0, 0, 2, 0, 2, 2])  # class 1 is missing at this site
    trainer = make_trainer("fedrs", linear, site, FedRsConfig(alpha=0.25, restriction="hard"))
    x, y = site.train.tensors
    z = linear(x)
    scaled = z * torch.tensor([1.0, 0.25, 1.0], dtype=torch.float64)
    prior = torch.log(torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64) + 1e-9)
    assert trainer.compute_loss(x, y).item() == pytest.approx(F.cross_entropy(scaled + prior, y).item(), abs=1e-12)
    assert torch.equal(trainer.predict_logits(x), z)


def test_ce_variant_is_the_published_fedrs(linear) -> None:
    site = make_site(n=6, labels=[0, 0, 2, 0, 2, 2])
    trainer = make_trainer("fedrs", linear, site, FedRsConfig(alpha=0.0, restriction="hard", loss="ce"))
    x, y = site.train.tensors
    scaled = linear(x) * torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    assert trainer.compute_loss(x, y).item() == pytest.approx(F.cross_entropy(scaled, y).item(), abs=1e-12)


def _relative_gap_to_bsm_fl(fedrs_cfg: FedRsConfig) -> float:
    """||grad_fedrs - grad_bsm-fl|| / ||grad_bsm-fl|| for one batch of a site that lacks class 1 and has a rare
    class 2 (same weights, same prior floor)."""
    site = make_site(n=9, labels=[0, 0, 0, 0, 0, 0, 0, 2, 2])
    x, y = site.train.tensors
    grads = []
    for method, cfg in (("fedrs", fedrs_cfg), ("bsm-fl", BsmFlConfig(eps=fedrs_cfg.eps))):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).double()
        loss = make_trainer(method, model, site, cfg).compute_loss(x, y)
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))]))
    return ((grads[0] - grads[1]).norm() / grads[1].norm()).item()


def test_hard_restriction_under_balanced_softmax_trains_as_bsm_fl() -> None:
    # BSM already gives the missing class the offset log(1e-9): the hard alpha only touches that class, so the
    # update moves by ~1e-9 relative, below float32 resolution (why a benchmark cell of it equals BSM-FL's).
    assert _relative_gap_to_bsm_fl(FedRsConfig(restriction="hard")) < 1e-6


def test_default_fedrs_trains_differently_from_bsm_fl() -> None:
    # The default (soft, the authors' code) also restricts the rare present class 2, which BSM does not.
    assert _relative_gap_to_bsm_fl(FedRsConfig()) > 1e-2


@pytest.mark.parametrize("field, value", [("alpha", -0.1), ("restriction", "x"), ("loss", "focal")])
def test_bad_config_is_refused(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        FedRsConfig(**{field: value})


def test_default_is_balanced_softmax_on_soft_restricted_logits_with_alpha_one_half(linear) -> None:
    site = make_site(n=6, labels=[0, 0, 2, 0, 2, 0])  # counts (4, 0, 2): class 1 missing, class 2 rarer
    trainer = make_trainer("fedrs", linear, site)  # FedRsConfig(): alpha 0.5, soft (the authors' code), bsm
    x, y = site.train.tensors
    scales = torch.tensor([1.0, 0.5, 0.5 + 0.5 * 2 / 4], dtype=torch.float64)  # alpha + (1 - alpha) * n_c / max n
    prior = torch.log(torch.tensor([4 / 6, 0.0, 2 / 6], dtype=torch.float64) + 1e-9)
    expected = F.cross_entropy(linear(x) * scales + prior, y)
    assert trainer.compute_loss(x, y).item() == pytest.approx(expected.item(), abs=1e-12)
