"""The shared trainer on multi-label data: sigmoid scores, BCE over known entries, and methods that refuse it."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from medflare.errors import ConfigError, DataError
from medflare.losses import masked_bce, weighted_bce
from medflare.metrics import MultiLabelEvalStats
from medflare.plan import multi_label_methods, task_of
from medflare.registry import get_method, list_methods
from medflare.run_config import RunConfig
from medflare.site_config import SiteSettings, TaskSpec, check_multi_label_support
from medflare.site_runtime import SiteRuntime

from ._trainers import make_trainer

LABELS = torch.tensor([[1, 0, -1], [-1, -1, -1], [0, 1, 1], [1, -1, 0]])
ML_DATA = {"source": "synthetic:multilabel=1,classes=4,n=80,size=8", "num_sites": 2}


def multi_label_site() -> SimpleNamespace:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    dataset = TensorDataset(x, LABELS)
    dataset.labels = LABELS.numpy()  # as ImageDataset exposes them
    counts = (LABELS == 1).sum(dim=0).numpy()
    return SimpleNamespace(train=dataset, val=dataset, test=dataset, num_classes=3, class_counts=counts,
                           multi_label=True)


def test_default_loss_is_bce_over_known_entries_and_unknowns_get_no_gradient(linear: torch.nn.Module) -> None:
    trainer = make_trainer("fedavg", linear, multi_label_site())
    x = trainer.data.train.tensors[0]
    logits = linear(x)
    logits.retain_grad()

    loss = trainer.supervised_loss(logits, LABELS)
    loss.backward()

    known = LABELS >= 0
    by_hand = F.binary_cross_entropy_with_logits(logits[known], LABELS[known].double())
    assert loss.item() == pytest.approx(by_hand.item(), abs=1e-12)
    assert trainer.compute_loss(x, LABELS).item() == pytest.approx(by_hand.item(), abs=1e-12)
    assert torch.all(logits.grad[~known] == 0) and torch.all(logits.grad[known] != 0)


def test_weighted_bce_weights_each_element_before_the_mean() -> None:
    """An element of weight 0 gets no gradient; the mean is over all B×K elements (spec §5(e)2)."""
    logits = torch.tensor([[0.3, -1.2], [2.0, 0.1]], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[1.0, 0.0], [0.25, 1.0]], dtype=torch.float64)
    weights = torch.tensor([[2.0, 0.0], [1.0, 0.5]], dtype=torch.float64)
    loss = weighted_bce(logits, targets, weights)
    loss.backward()
    p = torch.sigmoid(logits.detach())
    by_hand = -(weights * (targets * torch.log(p) + (1 - targets) * torch.log(1 - p))).sum() / 4
    assert loss.item() == pytest.approx(by_hand.item(), abs=1e-12)
    assert logits.grad[0, 1] == 0 and torch.all(logits.grad.flatten()[[0, 2, 3]] != 0)
    assert masked_bce(logits, torch.full((2, 2), -1)).item() == 0.0  # nothing known: no loss, not NaN


def test_scores_are_sigmoids_and_evaluation_is_multi_label(linear: torch.nn.Module) -> None:
    trainer = make_trainer("fedavg", linear, multi_label_site())
    labels, probs, losses = trainer.predictions("test")
    with torch.no_grad():
        expected = torch.sigmoid(linear(trainer.data.test.tensors[0])).numpy()
    np.testing.assert_allclose(probs, expected, rtol=1e-6)
    assert losses[1] == 0.0  # the row without any known entry
    stats = trainer.evaluate("test")
    assert isinstance(stats, MultiLabelEvalStats) and stats.count == 3
    assert trainer.labelled_samples() == 3


def test_single_label_methods_refuse_multi_label_tasks_before_launch() -> None:
    task = TaskSpec(num_classes=4, in_channels=3, image_size=8, multi_label=True)
    with pytest.raises(ConfigError, match=r"'bsm-fl' trains single-label classifiers .* use one of .*fedavg"):
        check_multi_label_support(get_method("bsm-fl"), task, multi_label_methods())
    check_multi_label_support(get_method("fedprox"), task)
    with pytest.raises(ConfigError, match="'ldam-drw' trains single-label"):  # every launcher reads the task first
        task_of(RunConfig(method="ldam-drw", data=ML_DATA))
    assert task_of(RunConfig(method="fedavg", data=ML_DATA)).multi_label


def test_a_site_whose_data_disagrees_with_the_task_kind_fails_clearly() -> None:
    settings = SiteSettings(spec=get_method("fedavg"), task=TaskSpec(4, 3, 8), data={**ML_DATA, "seed": 0})
    with pytest.raises(DataError, match="site's data is multi-label but the job declares a single-label task"):
        SiteRuntime(settings, "site-1", 0, log=lambda m: None)


def test_readme_names_exactly_the_methods_that_run_multi_label() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    sentence = readme.split("Multi-label tasks (several findings per image")[1].split("(sigmoid per class")[0]
    named = set(re.findall(r"`([a-z0-9-]+)`", sentence))
    assert named == {name for name in list_methods() if get_method(name).multi_label}
