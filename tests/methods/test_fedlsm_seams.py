"""FedLSM's seams (issue 62) through the real paths: the evaluation as the controller summarises it (and the in-process
engine, which must evaluate as the FLARE path does), a site's class subset reaching the labels its data build
produces, the round schedule of pseudo-labels, EMA and local iterations, which parameters each loss term and the
class-count weighting reach, and every value of ``--preset paper`` against the paper's tables."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, precision_recall_fscore_support, roc_auc_score

from medflare import contracts
from medflare.data import DataConfig, make_site_data
from medflare.evaluation import summarize
from medflare.flare.aggregator import RoundAggregation
from medflare.flare.run_results import RunResults, new_record
from medflare.flare.tasks import TASK_VALIDATE
from medflare.methods.base import RoundContext
from medflare.methods.fedlsm import SPEC, client as fedlsm_client
from medflare.methods.fedlsm.server import POS_WEIGHT, Q_KEY
from medflare.methods.presets import PAPER
from medflare.metrics.eval_stats import DEFAULT_BINS, score_bins
from medflare.metrics.roc import binned_auc_error_bound
from medflare.plan import preset_layer, resolve, validated
from medflare.run_config import RunConfig, merge_run_config
from tests.benchmarks.conftest import load_benchmark

from .test_fedlsm import fedlsm_trainer

SINGLE = "synthetic:n=60,classes=3,size=8"
MULTI = "synthetic:multilabel=1,classes=4,n=60,size=8"


# ----- the jobs: a few in-process rounds as the controller plays them ------------------------------------------------
@dataclass
class Job:
    """One in-process FedLSM job: its plan, the engine's final evaluations, each site's validate meta, the rounds
    (with the accepted updates), and the sites as built."""

    plan: Any
    evaluations: dict
    validate_meta: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)
    sites: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def engine() -> ModuleType:
    return load_benchmark("inprocess")


def run_job(engine: ModuleType, source: str, classes_per_site: int) -> Job:
    run = RunConfig(method="fedlsm", rounds=1, clients=2, model="cnn", site_evaluation="final",
                    data={"source": source, "augment": "none", "partition": f"labelset:{classes_per_site}"},
                    train={"batch_size": 12, "lr": 0.01},
                    method_args={"local_iterations": 4, "uncertain_pool": 4, "confident_pool": 6})
    plan = resolve(run, "byoc")
    job = Job(plan, {})

    def deliver(runtime, task_name: str, arrays: dict, header: dict) -> tuple[dict, dict]:
        result = engine.run_at_site(runtime, task_name, arrays, header)
        if task_name == TASK_VALIDATE:
            job.validate_meta[runtime.site_name] = result[1]
        return result

    _, job.evaluations = engine.run_rounds(plan, deliver=deliver, on_round=job.rounds.append,
                                           on_sites=lambda sites: job.sites.update(sites.sites))
    return job


@pytest.fixture(scope="module")
def multi_label_job(engine: ModuleType) -> Job:
    return run_job(engine, "synthetic:multilabel=1,classes=4,n=120,n_val=8,n_test=60,size=16", 2)


@pytest.fixture(scope="module")
def single_label_job(engine: ModuleType) -> Job:
    return run_job(engine, "synthetic:n=120,classes=3,n_val=8,n_test=60,size=16", 2)


def pooled_test_predictions(job: Job) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each site's (labels, scores) of the final model on its test split, as its trainer predicts them."""
    predictions = [job.sites[site].trainer.predictions("test") for site in sorted(job.sites)]
    return [labels for labels, _, _ in predictions], [scores for _, scores, _ in predictions]


def as_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=lambda v: np.asarray(v).tolist())


# ----- evaluation aggregation -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["multi_label", "single_label"])
def test_in_process_final_evaluation_is_the_flare_controllers(kind: str, engine: ModuleType,
                                                             request: pytest.FixtureRequest) -> None:
    """The in-process engine parses each site's validate statistics as the controller's RunResults does (the job's
    class count and kind: a multi-label job's statistics are multi-label ones, which it used to parse as single-label
    and refuse) and summarises them as the controller does (shot groups, robust.max_share)."""
    job: Job = request.getfixturevalue(f"{kind}_job")
    results, by_controller = RunResults("auc_macro_ovr"), {}
    task = job.plan.task
    for site, meta in sorted(job.validate_meta.items()):
        assert results.accept_site_result(new_record(1, 0.0), by_controller, site, meta, task.num_classes,
                                          task.multi_label) == ""
    assert sorted(by_controller) == sorted(job.evaluations) == sorted(job.sites)
    cap = RoundAggregation.of_plan(job.plan).robust.max_share
    expected = summarize(by_controller, job.plan.shot_groups, share_cap=cap)
    assert as_json(engine.final_summary(job.plan, job.evaluations)) == as_json(expected)


def test_multi_label_headline_is_the_mean_per_class_auroc_of_the_pooled_test_sets(multi_label_job: Job,
                                                                                 engine: ModuleType) -> None:
    """Paper §3.2 ("for Task 1 ... AUC to evaluate the performance of each disease", Table 1 "Average AUC"; spec §5(d):
    per-class AUROC and its plain mean, of the global model): the sites' statistics are pooled, each finding's AUROC
    is that of the pooled scores (exactly sklearn's on the scores binned as the sites bin them, within the binned AUC's
    error bound of the raw scores), and the headline is their unweighted mean (not weighted by positives, not micro)."""
    labels, scores = pooled_test_predictions(multi_label_job)
    y, p = np.concatenate(labels), np.concatenate(scores)
    binned = score_bins(p, DEFAULT_BINS)
    per_class = [roc_auc_score(y[:, c], binned[:, c]) for c in range(y.shape[1])]
    test = engine.final_summary(multi_label_job.plan, multi_label_job.evaluations)["test"]
    np.testing.assert_allclose(test["per_class_auc"], per_class, rtol=0, atol=1e-12)
    assert test["auc_macro_ovr"] == pytest.approx(np.mean(per_class), rel=0, abs=1e-12)
    exact = [roc_auc_score(y[:, c], p[:, c]) for c in range(y.shape[1])]
    np.testing.assert_allclose(per_class, exact, rtol=0, atol=auc_bound(multi_label_job) + 1e-12)
    # the case tells the macro mean from the weighted (by positives) and the micro AUROC
    assert abs(np.mean(per_class) - roc_auc_score(y, binned, average="weighted")) > 1e-3
    assert abs(np.mean(per_class) - roc_auc_score(y, binned, average="micro")) > 1e-3


def auc_bound(job: Job) -> float:
    """The largest gap between a class's binned and exact AUROC in the job's pooled test statistics."""
    stats = summarize(job.evaluations)["test_stats"]
    return max(binned_auc_error_bound(np.asarray(ph), np.asarray(nh)) for ph, nh in zip(stats["pos_hist"], stats["neg_hist"]))


def test_single_label_metrics_are_the_papers_macro_averages_of_the_pooled_test_sets(single_label_job: Job,
                                                                                   engine: ModuleType) -> None:
    """Paper §3.2 and Table 2 (Task 2: "macro average of AUC, Accuracy, F1, Precision and Recall"; spec §5(d):
    roc_auc_score(multi_class='ovr', average='macro') and classification_report's macro avg) on the pooled test
    predictions of the global model."""
    labels, scores = pooled_test_predictions(single_label_job)
    y, p = np.concatenate(labels), np.concatenate(scores)
    predicted, binned = p.argmax(axis=1), score_bins(p, DEFAULT_BINS)
    test = engine.final_summary(single_label_job.plan, single_label_job.evaluations)["test"]
    one_vs_rest = [roc_auc_score(y == c, binned[:, c]) for c in range(p.shape[1])]  # sklearn's 'ovr', per class
    assert test["auc_macro_ovr"] == pytest.approx(np.mean(one_vs_rest), rel=0, abs=1e-12)
    assert test["auc_macro_ovr"] == pytest.approx(roc_auc_score(y, p, multi_class="ovr", average="macro"),
                                                  rel=0, abs=auc_bound(single_label_job) + 1e-12)
    precision, recall, f1, _ = precision_recall_fscore_support(y, predicted, average="macro", zero_division=0)
    assert (test["macro_precision"], test["macro_recall"], test["macro_f1"]) == pytest.approx((precision, recall, f1))
    assert test["accuracy"] == pytest.approx(accuracy_score(y, predicted))
