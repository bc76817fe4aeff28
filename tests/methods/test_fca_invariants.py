"""FCA at the site runtime: the specialization is scored before the global model lands (train and validate), every
site's personal head starts from its own seed, the defaults are the paper's, and the server averages (and holds)
only the shared keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medflare import contracts
from medflare.evaluation import SPECIALIZATION
from medflare.methods.base import RoundContext, SiteUpdate
from medflare.methods.fca import FcaConfig
from medflare.plan import build_global_model
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

TASK = TaskSpec(num_classes=3, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=120,classes=3", "num_sites": 2, "partition": "iid"}
QUICK = {"max_steps": 1, "batch_size": 8, "eval_batch_size": 64}


def fca_site(index: int = 0, seed: int = 0) -> SiteRuntime:
    settings = SiteSettings(spec=get_method("fca"), task=TASK, data=DATA, model="cnn", train=QUICK, seed=seed)
    return SiteRuntime(settings, f"site-{index + 1}", index, log=lambda message: None)


def global_weights(seed: int) -> dict[str, np.ndarray]:
    network = build_global_model("fca", "cnn", TASK.num_classes, TASK.in_channels, TASK.image_size, seed=seed)
    return {k: v.numpy() for k, v in network.state_dict().items()}


def own_model_scores(site: SiteRuntime) -> dict[str, dict]:
    """The specialization statistics of the site's own model (extractor + personal head) as it stands now."""
    return {split: site.trainer.extra_evaluations(split)[SPECIALIZATION].to_dict() for split in ("val", "test")}


def global_model_scores(weights: dict[str, np.ndarray]) -> dict:
    """The test statistics of ``weights`` (the federated head) on site 1's test split."""
    site = fca_site()
    site.trainer.receive(weights)
    return site.trainer.evaluate("test").to_dict()


# ----- specialization scores the site's own model, before the global model is loaded ----------------------------
def test_train_scores_the_sites_own_model_before_loading_the_global_one() -> None:
    site = fca_site()
    site.train(global_weights(seed=1), RoundContext(0, 3))
    own = own_model_scores(site)
    incoming = global_weights(seed=2)
    _, meta = site.train(incoming, RoundContext(1, 3))
    assert meta[contracts.EVAL_EXTRA][SPECIALIZATION] == own
    assert meta[contracts.EVAL_TEST] == global_model_scores(incoming)  # the global evaluation scores what came in
    assert own["test"] != meta[contracts.EVAL_TEST]  # the two models differ, so the order is visible


def test_validate_scores_the_sites_own_model_before_loading_the_final_one() -> None:
    site = fca_site()
    site.train(global_weights(seed=1), RoundContext(0, 1))
    own = own_model_scores(site)
    final = global_weights(seed=2)
    meta = site.validate(final)
    assert meta[contracts.EVAL_EXTRA][SPECIALIZATION] == own
    assert meta[contracts.EVAL_TEST] == global_model_scores(final)
    assert own["test"] != meta[contracts.EVAL_TEST]


# ----- personal heads start different at every site ----------------------------------------------------------------
def personal_head(site: SiteRuntime) -> torch.Tensor:
    return site.model.personal_head.weight.detach().clone()


def test_each_site_seeds_its_own_personal_head_and_reproducibly() -> None:
    first, second = personal_head(fca_site(0)), personal_head(fca_site(1))
    assert not torch.allclose(first, second)  # spec §6(e)3: personal heads are seeded locally, per site
    assert torch.equal(first, personal_head(fca_site(0)))  # the same site of the same job starts the same
    assert not torch.equal(first, personal_head(fca_site(0, seed=5)))  # another job seed, another head


def test_the_broadcast_model_replaces_every_shared_key_but_not_the_personal_heads() -> None:
    sites = [fca_site(0), fca_site(1)]
    broadcast = global_weights(seed=3)
    for site in sites:
        site.trainer.receive(broadcast)
    shared = [{k: v for k, v in site.model.state_dict().items() if not k.startswith("personal_head.")}
              for site in sites]
    assert all(torch.equal(shared[0][k], shared[1][k]) for k in shared[0])
    assert not torch.allclose(personal_head(sites[0]), personal_head(sites[1]))


# ----- the paper's defaults --------------------------------------------------------------------------------------
def test_defaults_are_the_papers_lambdas_and_prior_floor() -> None:
    cfg = FcaConfig()
    # paper Table 7 / notebook LAM1, LAM2 = 1, 3; consistency weight 1, KL at T = 1; BSM eps 1e-9 (spec §1.1)
    assert (cfg.lambda_fed, cfg.lambda_personal, cfg.consistency_weight) == (1.0, 3.0, 1.0)
    assert (cfg.consistency, cfg.temperature, cfg.eps) == ("kl", 1.0, 1e-9)


# ----- the server: FedAvg of the shared keys, no personal head held -----------------------------------------------
def test_the_server_averages_the_shared_keys_by_sample_count_and_holds_no_personal_head() -> None:
    spec = get_method("fca")
    start = global_weights(seed=0)
    assert start and not any(k.startswith("personal_head.") for k in start)
    rule = spec.server_rule_cls(FcaConfig(), 2, spec.payload)
    ctx = RoundContext(0, 2)
    sent = rule.phase_arrays(contracts.TRAIN_PHASE, ctx, start, {})
    assert set(sent) == set(start)  # the whole server model is broadcast: extractor and federated head
    floats = [k for k, v in start.items() if v.dtype.kind == "f"]
    updates = [SiteUpdate(site, {k: np.full_like(start[k], value) for k in floats}, {contracts.N_SAMPLES: n})
               for site, value, n in (("site-1", 1.0, 1), ("site-2", 5.0, 3))]
    result = rule.aggregate(start, updates, ctx)
    for key in floats:
        np.testing.assert_allclose(result.params[key], 4.0, rtol=1e-6)  # (1·1 + 3·5) / 4
    assert set(result.params) == set(start)


@pytest.mark.parametrize("key", ["personal_head.weight", "personal_head.bias"])
def test_the_server_refuses_a_result_that_carries_a_personal_head(key: str) -> None:
    from medflare.server_round import RoundAggregation

    start = global_weights(seed=0)
    core = RoundAggregation(get_method("fca"), {}, num_classes=TASK.num_classes, num_rounds=2)
    core.start_round(start, RoundContext(0, 2))
    core.start_phase(contracts.TRAIN_PHASE)
    site = fca_site()
    honest = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in site.trainer.outgoing_arrays().items()}
    leaked = {**honest, key: site.model.state_dict()[key].numpy().astype(np.float32)}
    assert "unexpected keys" in core.accept("site-2", leaked, {contracts.N_SAMPLES: 10})
    assert core.accept("site-1", honest, {contracts.N_SAMPLES: 10}) is None
