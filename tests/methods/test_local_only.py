"""local-only: the site's whole model is its state and never leaves or is replaced; the server holds no model; the
site's loss is the one chosen, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medflare import contracts
from medflare.evaluation import GENERALIZATION
from medflare.methods.base import RoundContext
from medflare.methods.local_only import LocalOnlyConfig
from medflare.ops import model_params
from medflare.plan import build_global_model
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec, resolve_site_model
from medflare.site_runtime import SiteRuntime

from ._generalization import check_generalization_by_hand
from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

LABELS = [0, 0, 2, 0, 2, 0]  # counts (4, 0, 2)


def test_the_whole_model_survives_a_state_round_trip_and_nothing_is_shared() -> None:
    site = make_site()
    trainer = make_trainer("local-only", tiny_classifier(), site, max_steps=2)
    trainer.train_round(RoundContext(0, 2))
    fresh = make_trainer("local-only", tiny_classifier(seed=7), site)
    fresh.load_state(trainer.state_dict())
    mine, restored = model_params(trainer.model), model_params(fresh.model)
    assert set(restored) == set(mine) and all(np.array_equal(restored[k], v) for k, v in mine.items())
    assert trainer.outgoing_arrays() == {}
    assert get_method("local-only").payload.shared_keys(list(mine)) == []


def test_weights_a_server_sends_never_replace_the_sites_model() -> None:
    trainer = make_trainer("local-only", tiny_classifier(), make_site())
    mine = model_params(trainer.model)
    trainer.receive({k: np.full_like(v, 7.0) for k, v in model_params(tiny_classifier(seed=3)).items()})
    assert all(np.array_equal(model_params(trainer.model)[k], v) for k, v in mine.items())


def test_the_server_holds_no_model_so_each_site_may_run_its_own_architecture() -> None:
    assert build_global_model("local-only", "cnn", 3, 1, 28).state_dict() == {}
    assert resolve_site_model(get_method("local-only"), "cnn", {"site-2": "vit_micro"}, "site-2", None) == "vit_micro"


def test_only_the_common_meta_leaves_a_site_and_it_scores_the_sites_own_model() -> None:
    settings = SiteSettings(spec=get_method("local-only"), task=TaskSpec(num_classes=3, in_channels=3, image_size=28),
                            data={"source": "synthetic:n=120,classes=3", "num_sites": 2, "partition": "iid"},
                            model="cnn", train={"max_steps": 1, "batch_size": 8})
    site = SiteRuntime(settings, "site-1", 0, log=lambda message: None)
    own = site.trainer.evaluate("test").to_dict()
    own_on_pool = site.trainer.evaluate("pooled_test").to_dict()
    arrays, meta = site.train({}, RoundContext(0, 2))
    assert arrays == {}
    assert set(meta) <= {contracts.N_SAMPLES, contracts.TRAIN_LOSS, contracts.TRAIN_SECONDS, contracts.EVAL_VAL,
                         contracts.EVAL_TEST, contracts.EVAL_TEST_BY_ATTRIBUTE, contracts.EVAL_EXTRA}
    assert meta[contracts.EVAL_TEST] == own
    assert meta[contracts.EVAL_EXTRA] == {GENERALIZATION: {"test": own_on_pool}}  # counts of its own model only


@pytest.mark.parametrize("loss", ["ce", "bsm", "sce"])
def test_the_chosen_loss_by_hand(loss: str, linear: torch.nn.Module) -> None:
    site = make_site(n=6, labels=LABELS)
    x, y = site.train.tensors
    trainer = make_trainer("local-only", linear, site, LocalOnlyConfig(loss=loss))
    z = linear(x)
    prior = torch.log(torch.tensor([4 / 6, 0.0, 2 / 6], dtype=torch.float64) + 1e-9)
    reverse = -math.log(1e-4) * (1 - torch.softmax(z, dim=1).clamp(min=1e-7).gather(1, y[:, None])).mean()
    expected = {"ce": F.cross_entropy(z, y), "bsm": F.cross_entropy(z + prior, y),
                "sce": 0.1 * F.cross_entropy(z, y) + reverse}[loss]
    assert trainer.compute_loss(x, y).item() == pytest.approx(expected.item(), abs=1e-9)


def test_the_default_loss_is_plain_cross_entropy() -> None:
    assert LocalOnlyConfig().loss == "ce"


def test_generalization_is_each_sites_own_model_on_the_pooled_test_set_by_hand() -> None:
    """FCA reports local learning's generalization (Tables 4-5): each site's own model on the pooled test set,
    averaged over sites; checked against a forward pass of each site's model over both sites' test slices."""
    check_generalization_by_hand("local-only")
