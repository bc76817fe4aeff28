"""local-only's seams (issue 62; local_only/ledger.toml): the defaults a default job's site reads, and its FCA
figures as the server combines the sites' own models' evaluations."""

from __future__ import annotations

import time

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score

from medflare.evaluation import summarize
from medflare.flare.run_results import RunResults, new_record
from medflare.methods.base import RoundContext
from medflare.registry import get_method

from ._run_sites import default_job_site


def test_a_default_job_trains_each_site_with_plain_cross_entropy_and_rhfls_sce_weights() -> None:
    """Preset: loss ce (FCA Tables 2-3's local training), FCA's BSM floor 1e-9 (spec §1.1), RHFL's α = 0.1 and
    β = 1.0 for sce (spec §1.4, MDH-FL's lower bound), as a default job's site trainer reads them."""
    cfg = default_job_site("local-only").trainer.cfg
    assert (cfg.loss, cfg.eps, cfg.sce_alpha, cfg.sce_beta) == ("ce", 1e-9, 0.1, 1.0)


def test_generalization_is_the_unweighted_mean_of_each_sites_own_model_on_the_pooled_test_set() -> None:
    """FCA §4.2 (local learning's G column, Table 4): each site's own model on the pooled test set, averaged over
    sites with equal weight (in bACC and bAUC); S: each on its own test split. Through each site's final validation, the controller's
    accept_site_result and summarize, and the method's final_metrics."""
    sites = [default_job_site("local-only", site=f"site-{i}", train={"local_epochs": 3, "lr": 0.05, "batch_size": 16}) for i in (1, 2)]
    results, evaluations, record = RunResults("balanced_accuracy"), {}, new_record(0, time.time())
    own, own_on_pool = [], []
    for site in sites:
        site.train({}, RoundContext(0, 1))
        for split, scores in (("test", own), ("pooled_test", own_on_pool)):
            labels, probs, _ = site.trainer.predictions(split)
            scores.append(balanced_accuracy_score(labels, probs.argmax(1)))
        meta = site.validate({}, RoundContext(1, 1))
        assert not results.accept_site_result(record, evaluations, site.site_name, meta, 4, False)
    rule = get_method("local-only").server_rule_cls(get_method("local-only").config_cls(), 1)
    figures = rule.final_metrics(summarize(evaluations))
    assert figures["generalization_bacc"] == pytest.approx(float(np.mean(own_on_pool)), abs=1e-12)
    assert figures["specialization_bacc"] == pytest.approx(float(np.mean(own)), abs=1e-12)
    # every site scores the same pooled set, so the pooled bACC equals the mean; bAUC tells the two apart
    by_site = figures["generalization_by_site"]
    assert [by_site[site.site_name]["bacc"] for site in sites] == pytest.approx(own_on_pool, abs=1e-12)
    assert figures["generalization_bauc"] == pytest.approx(float(np.mean([m["bauc"] for m in by_site.values()])),
                                                           abs=1e-12)
    assert own_on_pool[0] != pytest.approx(own_on_pool[1])  # two different models: the mean is not one site's
