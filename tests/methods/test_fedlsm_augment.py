"""FedLSM's two views: by default the authors' weak view (Resize + H-flip) for the teacher and their strong view
(flips, additive brightness, median/Gaussian blur or Gaussian noise, shift-scale-rotate) for the student, spec §5(c)."""

from __future__ import annotations

import torch
from torch import nn

from medflare.data import DataConfig, make_site_data
from medflare.methods.base import TrainConfig
from medflare.methods.fedlsm import SPEC, FedLsmConfig
from medflare.methods.fedlsm.client import FedLsmTrainer
from medflare.models import Classifier


def _trainer(**method_args: object) -> FedLsmTrainer:
    data = make_site_data(DataConfig(source="synthetic:n=40,classes=3,size=8", partition="labelset:2", num_sites=2), 0)
    torch.manual_seed(0)
    net = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4)), nn.Linear(4, data.num_classes))
    cfg = FedLsmConfig(local_iterations=1, uncertain_pool=4, confident_pool=6, **method_args)
    return FedLsmTrainer(net, data, TrainConfig(batch_size=12), cfg, SPEC.payload, torch.device("cpu"),
                         log=lambda message: None)


def test_the_default_views_are_the_codes_weak_and_strong_pipelines() -> None:
    assert (FedLsmConfig().weak_augment, FedLsmConfig().strong_augment) == ("weak", "fedlsm_strong")
    weak, strong = _trainer().two_views.transforms
    assert (weak.augment, strong.augment) == ("weak", "fedlsm_strong")


def test_the_strong_view_can_still_be_chosen() -> None:
    weak, strong = _trainer(strong_augment="strong", weak_augment="none").two_views.transforms
    assert (weak.augment, strong.augment) == ("none", "strong")
