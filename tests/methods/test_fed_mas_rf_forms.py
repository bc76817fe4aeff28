"""Fed-MAS's two rescue-factor forms (issue 62): ``rf_normalise`` true, the authors' code (w and ŵ normalised to sum 1,
RF in (0, 1]); false, Eq. 3 as the paper prints it (RF = Σ_k w_k ŵ_k, up to K · 4 · 4E). Each form is checked by hand,
on what the trainer sends, and at both ends' bound (the site's own check and the server's), with the job's epochs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from medflare.contracts import Payload
from medflare.errors import ConfigError, PayloadError
from medflare.methods.base import RoundContext
from medflare.methods.fed_mas import FedMasConfig
from medflare.methods.fed_mas.rescue import eq3_bound, rescue_factor
from medflare.plan import build_plan, task_of, validated
from medflare.registry import get_method
from medflare.run_config import RunConfig
from medflare.server_round import RoundAggregation
from medflare.site_runtime import SiteRuntime, SiteSettings

from .test_fed_mas import SITE_OPTIONS, tiny_fedmas_trainer


def test_eq3_rescue_factor_is_the_plain_dot_product_over_the_sites_classes() -> None:
    # Eq. 3: 0.2·1 + 0.6·3 = 2.0; the class the global model never scored (w = 0) is left out, as in the code's form
    assert rescue_factor(np.array([0.2, 0.6]), np.array([1.0, 3.0]), normalise=False) == pytest.approx(2.0)
    assert rescue_factor(np.array([0.2, 0.0, 0.6]), np.array([1.0, 5.0, 3.0]), normalise=False) == pytest.approx(2.0)


def test_a_shift_raising_every_class_alike_raises_eq3s_rf_and_not_the_normalised_one() -> None:
    """The attribute shift of the paper's Fig. 3 raises a site's divergence in every class: the code's normalisation
    cancels it, Eq. 3 multiplies RF by the square of the factor."""
    w, w_hat = np.array([0.4, 0.8, 1.2]), np.array([2.0, 1.0, 3.0])
    assert rescue_factor(1.5 * w, 1.5 * w_hat) == pytest.approx(rescue_factor(w, w_hat))
    assert rescue_factor(1.5 * w, 1.5 * w_hat, normalise=False) == pytest.approx(
        2.25 * rescue_factor(w, w_hat, normalise=False))


def test_the_trainer_sends_the_rf_of_the_jobs_form(tmp_path: Path) -> None:
    """What the site's trainer sends, from the w and ŵ it measured this round, in the form its config names."""
    for normalise in (True, False):
        trainer, _ = tiny_fedmas_trainer(tmp_path, rf_normalise=normalise)
        meta = trainer.train_round(RoundContext(0, 2))
        w_hat = trainer.w_hat.per_class(trainer.data.class_counts)
        assert meta["rf"] == pytest.approx(rescue_factor(trainer.w, w_hat, normalise=normalise), rel=1e-6)
        assert meta["rf"] != pytest.approx(rescue_factor(trainer.w, w_hat, normalise=not normalise), rel=1e-3)


def rf_verdict(rf: float, local_epochs: int, **method_args) -> str | None:
    """The server's verdict on a site's RF (None: accepted), for a two-class task."""
    core = RoundAggregation(get_method("fedmas"), method_args, num_classes=2, num_rounds=4, local_epochs=local_epochs)
    core.start_round({"w": np.zeros(2, np.float32)}, RoundContext(0, 4))
    core.start_phase("train")
    return core.accept("site", {"w": np.ones(2, np.float32)}, {"n_samples": 5, "rf": rf})


def test_the_servers_rf_bound_is_what_the_jobs_form_and_epochs_can_reach() -> None:
    """Normalised: (0, 1]. Eq. 3 with K = 2 classes and E = 3 epochs: (0, 2 · 4 · 4 · 3 = 96]."""
    assert eq3_bound(2, 3) == 96
    assert rf_verdict(1.5, 3) is not None  # the code's form cannot reach 1.5
    assert rf_verdict(1.5, 3, rf_normalise=False) is None
    assert rf_verdict(96.0, 3, rf_normalise=False) is None
    assert "rf" in rf_verdict(96.5, 3, rf_normalise=False)
    assert "rf" in rf_verdict(40.0, 1, rf_normalise=False)  # one epoch reaches 32 at most
    assert "rf" in rf_verdict(0.0, 3, rf_normalise=False)


def test_the_sites_own_check_bounds_eq3s_rf_by_its_own_epochs() -> None:
    """The site checks what it sends against its own config: 5 classes, 2 epochs -> Eq. 3's RF <= 160."""
    arrays = {}
    for normalise, epochs, rf, allowed in ((False, 2, 100.0, True), (False, 2, 170.0, False),
                                           (True, 2, 1.5, False)):
        settings = SiteSettings(**{**SITE_OPTIONS, "method_args": {**SITE_OPTIONS["method_args"],
                                                                  "rf_normalise": normalise},
                                   "train": {**SITE_OPTIONS["train"], "local_epochs": epochs}})
        runtime = SiteRuntime(settings, "site-1", 0, log=lambda m: None)
        meta = {"n_samples": 5, "rf": rf}
        if allowed:
            runtime._check_outgoing(arrays, meta, "train", RoundContext(0, 2))
        else:
            with pytest.raises(PayloadError, match="rf"):
                runtime._check_outgoing(arrays, meta, "train", RoundContext(0, 2))


def test_the_server_takes_the_most_local_epochs_of_the_plans_sites() -> None:
    """The round core a plan builds bounds Eq. 3's RF by the largest local epochs any of its sites trains."""
    run = validated(RunConfig(method="fedmas", method_args={"rf_normalise": False}, clients=2,
                              data={"source": "synthetic:n=200"}, site_train={"site-2": {"local_epochs": 3}}))
    plan = build_plan(run, task_of(run), {})
    assert plan.max_local_epochs == 3
    core = RoundAggregation.of_plan(plan)
    core.start_round({}, RoundContext(0, len(plan.rounds)))
    core.start_phase("train")
    assert core.contract.local_epochs == 3


def test_eq3_has_no_inverse_form() -> None:
    with pytest.raises(ConfigError, match="rf_normalise=false"):
        FedMasConfig(aggregation="mas_inv", rf_normalise=False)
    FedMasConfig(aggregation="mas_drw", rf_normalise=False)  # the DRW factors read 1/RF, which Eq. 3 keeps positive


def test_a_config_dependent_payload_may_change_only_its_meta_bounds() -> None:
    spec = get_method("fedmas")
    assert spec.payload_of(FedMasConfig()).allowed_meta().keys() == spec.payload.allowed_meta().keys()
    import dataclasses

    leaky = dataclasses.replace(spec, payload_for=lambda cfg: Payload(private_keys="nothing"))
    with pytest.raises(ValueError, match="only the meta"):
        leaky.payload_of(FedMasConfig())
