"""Builders for the seam tests (issue 62): real sites from the data build, the evaluation as the controller pools it,
and a paper preset as a run resolves it (not collected: no ``test_`` prefix)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import pytest
import torch

from medflare.evaluation import site_evaluation, summarize
from medflare.methods.base import LocalTrainer, TrainConfig
from medflare.methods.presets import PAPER
from medflare.plan import preset_layer, validated
from medflare.registry import get_method
from medflare.run_config import RunConfig, merge_run_config
from medflare.site_config import SiteSettings, TaskSpec, resolve_train_config
from medflare.site_runtime import SiteRuntime

NUM_CLASSES = 5  # the synthetic source's default
IMAGE_SIZE = 28
# A long-tailed (data.imbalance) Dirichlet split in which every site lacks one whole class (spec §6(d))
LONG_TAIL_MISSING = {"source": "synthetic:n=600", "imbalance": 8.0, "partition": "longtail-missing:1.0:1",
                     "num_sites": 3, "min_size": 10}


def site_runtime(method: str, data: Mapping[str, Any], site_index: int = 0, **options: Any) -> SiteRuntime:
    """Site ``site_index`` of a simulated job as the FLARE executor builds it: its data from ``medflare.data``, the
    method's model and trainer (``options``: SiteSettings fields, e.g. ``train``, ``method_args``)."""
    settings = SiteSettings(spec=get_method(method), task=TaskSpec(num_classes=NUM_CLASSES, in_channels=3,
                                                                   image_size=IMAGE_SIZE), data=dict(data), **options)
    return SiteRuntime(settings, f"site-{site_index + 1}", site_index, log=lambda message: None)


def built_train_counts(trainer: LocalTrainer) -> np.ndarray:
    """Per-class counts of the labelled training samples the site's data build produced (read off the dataset)."""
    labels = np.asarray(trainer.train_dataset().labels)
    return np.bincount(labels[labels >= 0], minlength=int(trainer.data.num_classes))


def check_long_tail_reached(trainers: list[LocalTrainer], imbalance: float) -> None:
    """The job's ``data.imbalance`` reached the labels the sites train on: pooled over the sites, the largest class
    has ``imbalance`` times the smallest (up to the cut's flooring), and every site lacks a class (the split)."""
    pooled = sum(built_train_counts(trainer) for trainer in trainers)
    assert imbalance * 0.9 <= pooled.max() / pooled.min() <= imbalance, pooled
    assert all((built_train_counts(trainer) == 0).any() for trainer in trainers)


def first_batch(trainer: LocalTrainer) -> tuple[torch.Tensor, torch.Tensor]:
    """The first training batch the trainer's own loader gives (augmented images, built labels)."""
    images, labels = next(iter(trainer.train_loader()))
    return images.to(trainer.device), labels.to(trainer.device)


def check_loss_is_ce_on_count_shifted_logits(method: str, shift: Callable[[torch.Tensor], torch.Tensor],
                                             check_missing: Callable[[torch.Tensor], None]) -> None:
    """On every site of LONG_TAIL_MISSING (the job's long-tail cut reached, checked first), the trainer's loss of its
    own first batch is CE(z + shift(counts), y), ``counts`` the labels its data build produced (float64);
    ``check_missing`` checks the shift of the class the site lacks."""
    trainers = [site_runtime(method, LONG_TAIL_MISSING, index, train={"batch_size": 32}).trainer
                for index in range(LONG_TAIL_MISSING["num_sites"])]
    check_long_tail_reached(trainers, LONG_TAIL_MISSING["imbalance"])
    for trainer in trainers:
        images, labels = first_batch(trainer)
        trainer.model.eval()  # one deterministic forward for the loss and the hand-written reference
        offsets = shift(torch.as_tensor(built_train_counts(trainer), dtype=torch.float64))
        check_missing(offsets)
        with torch.no_grad():
            expected = torch.nn.functional.cross_entropy(trainer.model(images).double() + offsets, labels)
            loss = trainer.compute_loss(images, labels)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def split_tensors(trainer: LocalTrainer, split: str) -> tuple[torch.Tensor, np.ndarray]:
    """Every image and label of one evaluation split of the site, in dataset order."""
    dataset = getattr(trainer.data, split)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    return images, np.asarray(dataset.labels)


def balanced_accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    """Mean recall over the classes present in ``labels`` (sklearn's balanced_accuracy_score), by hand."""
    return float(np.mean([np.mean(predicted[labels == k] == k) for k in np.unique(labels)]))


def final_summary(runtimes: list[SiteRuntime], arrays: Mapping[str, np.ndarray],
                  shot_groups: Mapping[str, list[int]] | None = None) -> dict[str, Any]:
    """The controller's final evaluation of ``arrays``: every site's validate meta, parsed and pooled by
    ``summarize`` (with the plan's head/medium/tail ``shot_groups``) as ``MedflareController`` does."""
    evaluations = {rt.site_name: site_evaluation(rt.validate(arrays), NUM_CLASSES) for rt in runtimes}
    return summarize(evaluations, shot_groups)


def paper_run(method: str) -> tuple[RunConfig, TrainConfig, Any]:
    """``--preset paper`` of ``method`` as every command resolves it: the typed run, the site's TrainConfig and the
    method's typed options."""
    run = validated(merge_run_config(preset_layer(PAPER, method), {"method": method}))
    spec = get_method(method)
    return run, resolve_train_config(spec, run.train), spec.config_of(run.method_args)


def pooled_test_logits(runtimes: list[SiteRuntime]) -> tuple[np.ndarray, torch.Tensor]:
    """(labels, raw outputs ``model(x)`` of each site's current model) over the union of the sites' test splits."""
    labels, logits = [], []
    for runtime in runtimes:
        images, site_labels = split_tensors(runtime.trainer, "test")
        runtime.model.eval()
        with torch.no_grad():
            logits.append(runtime.model(images.to(runtime.device)).float().cpu())
        labels.append(site_labels)
    return np.concatenate(labels), torch.cat(logits)


def pooled_raw_logit_scores(runtimes: list[SiteRuntime]) -> tuple[float, float]:
    """(balanced accuracy, mean CE) of the sites' raw outputs over the union of their test splits, by hand: what the
    pooled test metrics are when evaluation scores the plain logits."""
    all_labels, all_logits = pooled_test_logits(runtimes)
    losses = torch.nn.functional.cross_entropy(all_logits, torch.as_tensor(all_labels), reduction="none")
    return balanced_accuracy(all_labels, all_logits.argmax(dim=1).numpy()), float(losses.mean())


def check_pooled_test_scores_raw_logits(method: str, **options: Any) -> None:
    """The final pooled test metrics of ``method`` over the sites of LONG_TAIL_MISSING, as the controller computes
    them from the sites' evaluation counts, equal the raw logits' over the union of the test splits."""
    runtimes = [site_runtime(method, LONG_TAIL_MISSING, index, **options)
                for index in range(LONG_TAIL_MISSING["num_sites"])]
    summary = final_summary(runtimes, runtimes[0].shared_weights())
    balanced, loss = pooled_raw_logit_scores(runtimes)
    assert summary["test"]["balanced_accuracy"] == pytest.approx(balanced, abs=1e-9)
    assert summary["test"]["loss"] == pytest.approx(loss, rel=1e-4)
    assert summary["test_stats"]["count"] == sum(len(rt.data.test) for rt in runtimes)  # the union of test splits


def check_absent_class_is_not_pushed_down(method: str) -> None:
    """The trainer's loss on a built site's first batch leaves the logit of the class the site lacks (almost) alone:
    the head's bias of that class gets no gradient worth the name, while each present class's does, and plain CE on
    the same logits would push the absent class down."""
    trainer = site_runtime(method, LONG_TAIL_MISSING, train={"batch_size": 32}).trainer
    absent = built_train_counts(trainer) == 0
    images, labels = first_batch(trainer)
    trainer.model.eval()  # one deterministic forward
    trainer.model.zero_grad()
    trainer.compute_loss(images, labels).backward()
    bias_grad = trainer.model.head.bias.grad.abs()
    trainer.model.zero_grad()
    torch.nn.functional.cross_entropy(trainer.model(images), labels).backward()
    ce_grad = trainer.model.head.bias.grad.abs()
    assert absent.any() and float(bias_grad[absent].max()) < 1e-6, bias_grad
    assert bool((bias_grad[~absent] > 1e-4).all()), bias_grad
    assert float(ce_grad[absent].min()) > 1e-3  # the cross-entropy FedAvg trains with does push it down
