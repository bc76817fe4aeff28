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
from medflare.flare.run_results import RunResults, new_record
from medflare.flare.tasks import TASK_VALIDATE
from medflare.methods.base import RoundContext, TrainConfig
from medflare.methods.fedlsm import SPEC, FedLsmConfig, client as fedlsm_client
from medflare.methods.fedlsm.server import Q_KEY
from medflare.methods.presets import PAPER
from medflare.metrics.eval_stats import DEFAULT_BINS, score_bins
from medflare.metrics.roc import binned_auc_error_bound
from medflare.plan import preset_layer, resolve, validated
from medflare.run_config import RunConfig, merge_run_config
from medflare.server_round import RoundAggregation
from tests.benchmarks.conftest import load_benchmark

from .test_fedlsm import fedlsm_trainer, tiny_net

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


# ----- data option: a site's class subset reaches the labels its data build produces ---------------------------------
def masked_by_hand(truth: np.ndarray, identified: np.ndarray) -> np.ndarray:
    """The site's labels with every class it does not annotate unknown (-1): the sample (single-label) or the entry."""
    if truth.ndim == 2:
        return np.where(identified[None, :], truth, -1)
    return np.where(identified[truth], truth, -1)


@pytest.mark.parametrize("source", [SINGLE, MULTI])
@pytest.mark.parametrize("option", ["labelset", "identified"])
def test_a_sites_class_subset_marks_its_unannotated_labels_unknown(source: str, option: str) -> None:
    """Paper §2.1 and §3.2 (each client annotates s of the classes, the union of the annotated sets is every class,
    Eq. 2; spec §5(d)) through the site's data build: ``partition=labelset:2`` (the paper's random s classes per
    site) and an explicit ``data.identified`` mark every training label of a class the site does not annotate
    unknown (-1, card deviation: the paper writes 0), keep every other label, leave val and test whole, and the
    FedLSM trainer built on that data pseudo-labels exactly the unannotated classes."""
    explicit = {"identified": [[0], [1, 2]] if source == SINGLE else [[0, 1], [2, 3]]} if option == "identified" else {}
    partition = "labelset:2" if option == "labelset" else "iid"  # labelset deals the samples as iid does
    annotated = []
    for site in range(2):
        data = make_site_data(DataConfig(source=source, partition=partition, num_sites=2, **explicit), site)
        whole = make_site_data(DataConfig(source=source, partition="iid", num_sites=2), site)
        identified = np.asarray(data.identified, dtype=bool)
        annotated.append(identified)
        if option == "labelset":
            assert identified.sum() == 2
        truth, labels = np.asarray(whole.train.labels), np.asarray(data.train.labels)
        np.testing.assert_array_equal(labels, masked_by_hand(truth, identified))
        assert (labels == -1).any() and (labels >= 0).any()
        for split in ("val", "test"):
            np.testing.assert_array_equal(getattr(data, split).labels, getattr(whole, split).labels)
        trainer = fedlsm_client.FedLsmTrainer(tiny_net(data.num_classes), data, TrainConfig(batch_size=12),
                                              FedLsmConfig(uncertain_pool=4, confident_pool=6), SPEC.payload,
                                              torch.device("cpu"), log=lambda m: None)
        np.testing.assert_array_equal(trainer.pseudo_classes.numpy(), ~identified)
    assert np.logical_or.reduce(annotated).all()  # Eq. 2: every class is annotated somewhere


# ----- stage schedule: what each round's steps read --------------------------------------------------------------------
def test_pseudo_labels_fire_from_the_first_round_and_the_teacher_trails_by_a_constant_decay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Paper §2.3 and Table 4 (spec §5(a)4-5): no warm-up: in round 0 of 50 an unlabelled image whose teacher is
    confident about a class the site does not annotate is pseudo-labelled (and counted in q); a round is
    ``local_iterations`` (T) optimizer steps, not a pass over the pool; after each step the teacher moves to
    d·teacher + (1 − d)·student with the same d = 0.999 from the first step on (no mean-teacher ramp-up)."""
    trainer = fedlsm_trainer(SINGLE)
    unannotated = int(np.flatnonzero(~np.asarray(trainer.data.identified))[0])
    with torch.no_grad():
        trainer.model.head.bias[unannotated] = 20.0  # the received model is sure of that class everywhere
    received = [p.detach().clone() for p in trainer.model.parameters()]
    students: list[list[torch.Tensor]] = []
    after_step = trainer.after_step

    def record_and_update() -> None:
        students.append([p.detach().clone() for p in trainer.model.parameters()])
        after_step()

    monkeypatch.setattr(trainer, "after_step", record_and_update)
    meta = trainer.train_round(RoundContext(0, 50))
    assert len(students) == trainer.cfg.local_iterations == 3
    assert meta[Q_KEY][unannotated] > 0
    decay, expected = trainer.cfg.ema_decay, received
    for student in students:
        expected = [decay * e + (1 - decay) * s for e, s in zip(expected, student)]
    for teacher, want in zip(trainer.teacher.model.parameters(), expected):
        torch.testing.assert_close(teacher, want, rtol=0, atol=1e-6)


# ----- gradient reach ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("term", ["pool", "mixup"])
def test_each_multi_label_loss_term_reaches_every_student_layer_and_never_the_teacher(
    term: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multi-label (paper Eq. 5 and UDE, spec §5(a)5): the pool's weighted BCE alone (w/o UDE) and the MixUp BCE alone
    (every pool entry uncertain, so weight 0; the partners fully labelled) each give every student layer a gradient;
    the EMA teacher none."""
    trainer = fedlsm_trainer(MULTI, ude=term == "mixup")
    images, labels = trainer.draw_batch()
    teacher = trainer.teacher.model
    if term == "mixup":
        labels[:trainer.pool_rows] = -1
        labels[trainer.pool_rows:] = torch.tensor([1, 0, 1, 0])
        monkeypatch.setattr(trainer.teacher, "model", lambda x: torch.zeros(len(x), 4))  # sigmoid 0.5: uncertain
    trainer.model.train()
    trainer.compute_loss(images, labels).backward()
    for name, parameter in trainer.model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, f"the {term} term does not reach {name}"
    assert all(parameter.grad is None for parameter in teacher.parameters())


@pytest.mark.parametrize("source, repo_compat", [(SINGLE, False), (MULTI, False), (MULTI, True)])
def test_every_target_the_losses_get_is_a_constant(source: str, repo_compat: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Pseudo-labels are the teacher's (paper §2.3, f_g on the weak view): every target handed to a loss, the
    authors' soft multi-label targets (``repo_compat``, the teacher's sigmoid on uncertain entries) included, carries
    no gradient, so the student learns towards them and never moves them."""
    trainer = fedlsm_trainer(source, repo_compat=repo_compat)
    targets: list[torch.Tensor] = []

    def spying(loss):
        def spy(logits, target, *args, **kwargs):
            targets.append(target)
            return loss(logits, target, *args, **kwargs)
        return spy

    monkeypatch.setattr(fedlsm_client, "soft_cross_entropy", spying(fedlsm_client.soft_cross_entropy))
    monkeypatch.setattr(fedlsm_client, "weighted_bce", spying(fedlsm_client.weighted_bce))
    monkeypatch.setattr(fedlsm_client.F, "binary_cross_entropy_with_logits",
                        spying(fedlsm_client.F.binary_cross_entropy_with_logits))
    images, labels = trainer.draw_batch()
    trainer.model.train()
    trainer.compute_loss(images, labels).backward()
    assert len(targets) >= 2 and all(not t.requires_grad for t in targets)
    assert all(p.grad is not None for p in trainer.model.parameters())


def test_the_round_core_weights_classifier_rows_by_q_and_the_extractor_by_n(multi_label_job: Job) -> None:
    """Paper Eq. 7 (AWPA) through the round core FLARE's aggregator drives, on the sites' own results: classifier
    weight row and bias entry c ← Σ_k q_c^k ψ_{k,c} / Σ_j q_c^j (n_k for a class nobody counted); every other key
    ← Σ_k n_k θ_k / Σ n (FedAvg, §2.2)."""
    (done,) = multi_label_job.rounds
    updates, params = done.accepted, done.aggregate.params
    q = np.array([u.meta[Q_KEY] for u in updates], dtype=np.float64)  # [sites, K]
    n = np.array([float(u.meta[contracts.N_SAMPLES]) for u in updates])
    assert RoundAggregation.of_plan(multi_label_job.plan).robust.max_share == 0  # no cap: the plain weights
    row_weights = np.where(q.sum(axis=0) > 0, q, n[:, None])
    row_weights = row_weights / row_weights.sum(axis=0)
    for key in ("head.weight", "head.bias"):
        rows = np.stack([u.arrays[key] for u in updates]).astype(np.float64)
        by_q = np.einsum("sk,sk...->k...", row_weights, rows)
        np.testing.assert_allclose(params[key], by_q, rtol=1e-5, atol=1e-6)
        by_n = np.einsum("s,s...->...", n / n.sum(), rows)
        assert np.abs(by_q - by_n).max() > 1e-4  # the case tells q from n
    extractor = [k for k in params if not k.startswith("head.") and params[k].dtype.kind == "f"]
    assert extractor
    for key in extractor:
        by_n = np.einsum("s,s...->...", n / n.sum(), np.stack([u.arrays[key] for u in updates]).astype(np.float64))
        np.testing.assert_allclose(params[key], by_n, rtol=1e-5, atol=1e-6)


# ----- preset: every value of --preset paper against the paper ---------------------------------------------------------
PAPER_ISIC2018 = {
    "model": "densenet121",  # §3.2 "DenseNet121 as the backbone"
    "clients": 5,  # §3.2 Task 2: k = 5
    "rounds": 50,  # §3.2 "total communication rounds were 50"
    "data": {"image_size": 224},  # §3.2 Task 2 images resized to 224×224
    "train": {"optimizer": "adam", "lr": 1e-4,  # §3.2 Adam; Table 4 lr 1e-4
              "betas": [0.9, 0.99],  # §3.2 "momentum terms were set to 0.9 and 0.99"
              "weight_decay": 5e-4,  # Table 4 lr_decay 5e-4 (the authors' Adam weight decay, spec §5(c))
              "batch_size": 64},  # §3.2 "total batch size was 64"
    "method_args": {"local_iterations": 30,  # §3.2 "30 for Task 2"
                    "uncertain_pool": 50, "confident_pool": 200,  # n^h / n^l: the authors' ISIC config (spec §5(c))
                    "tau": 0.95, "tau_uncertain": 0.85,  # Table 4 Task 2 τ, τ_l
                    "lambda_ude": 0.1, "ema_decay": 0.999, "mixup_alpha": 0.2,  # Table 4 λ, EMA, α in MixUp
                    "mix_batch": 4,  # §3.2 "4 generated samples using UDE"
                    "aggregation": "awpa"},  # §2.4 Eq. 7 (the full method, not Table 3's ablations)
}


def test_every_value_of_the_paper_preset_is_the_papers_isic2018_setting() -> None:
    """FedLSM paper §3.2 and Table 4 (Task 2, ISIC2018), spec §5(c) for the pool sizes the paper leaves to its
    configs: the preset holds exactly these values, and each reaches the resolved job: the method's typed config,
    every site's optimizer (the learning rate constant and the Adam moments kept across rounds, as in the code: its
    scheduler is never stepped, spec §5(c), (a)1), the model, the sites and the rounds."""
    preset = SPEC.presets[PAPER]
    assert json.loads(json.dumps(preset.overrides)) == PAPER_ISIC2018
    run = validated(merge_run_config(preset_layer(PAPER, "fedlsm"),
                                     {"method": "fedlsm", "data": {"source": "synthetic:n=4000,classes=7"}}))
    plan = resolve(run, "byoc")
    assert (plan.model, len(plan.sites), len(plan.rounds), run.data["image_size"]) == (
        "densenet121", 5, 50, 224)
    method = plan.method_cfg
    assert {key: getattr(method, key) for key in PAPER_ISIC2018["method_args"]} == PAPER_ISIC2018["method_args"]
    for site in plan.sites:
        train = site.train
        assert (train.optimizer, train.lr, list(train.betas), train.weight_decay, train.batch_size) == (
            "adam", 1e-4, [0.9, 0.99], 5e-4, 64)
        assert (train.local_epochs, train.max_steps, train.lr_schedule, train.fresh_optimizer) == (
            1, 0, "constant", "never")
