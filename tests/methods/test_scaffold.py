"""scaffold: the local step, what a site sends and the aggregation, by hand (written by `medflare new-method`; change
them with the method, and keep ledger.toml's tests in step)."""

import numpy as np
import torch
import torch.nn.functional as F

from medflare import contracts
from medflare.methods.base import RoundContext, SiteUpdate
from medflare.registry import get_method

from ._trainers import make_trainer
from .conftest import make_site

METHOD = "scaffold"
LABELS = [0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1]  # -1: an unlabelled image


def test_the_local_step_is_cross_entropy_over_the_labelled_images(linear) -> None:
    site = make_site(labels=LABELS)
    trainer = make_trainer(METHOD, linear, site)
    x, y = site.train.tensors
    labelled = y >= 0

    torch.testing.assert_close(trainer.compute_loss(x, y), F.cross_entropy(linear(x[labelled]), y[labelled]))


def test_a_round_sends_every_trained_weight_and_its_labelled_count(linear) -> None:
    trainer = make_trainer(METHOD, linear, make_site(labels=LABELS))
    before = {key: value.clone() for key, value in linear.state_dict().items()}

    meta = trainer.train_round(RoundContext(0, 1))
    sent = trainer.outgoing_arrays()

    assert meta[contracts.N_SAMPLES] == 9
    assert set(sent) == set(before)
    assert all(not torch.equal(torch.as_tensor(sent[key]), before[key]) for key in before)


def test_the_server_averages_the_sites_weighted_by_their_labelled_counts() -> None:
    spec = get_method(METHOD)
    rule = spec.server_rule_cls(spec.config_cls(), 1, spec.payload)
    updates = [SiteUpdate("site-1", {"w": np.array([1.0, 2.0], np.float32)}, {contracts.N_SAMPLES: 1}),
               SiteUpdate("site-2", {"w": np.array([5.0, 6.0], np.float32)}, {contracts.N_SAMPLES: 3})]

    result = rule.aggregate({"w": np.zeros(2, np.float32)}, updates, RoundContext(0, 1))

    np.testing.assert_allclose(result.params["w"], [4.0, 5.0])
    assert result.shares == {"site-1": 0.25, "site-2": 0.75}
