"""Builders shared by the per-method reference tests (not collected: no ``test_`` prefix)."""

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from medflare.methods.base import LocalTrainer, TrainConfig
from medflare.models import Classifier
from medflare.registry import get_method


def make_trainer(
    method: str, model: nn.Module, site: SimpleNamespace, method_cfg: Any = None, **train: Any
) -> LocalTrainer:
    """The method's trainer with full-batch plain SGD (lr 0.1), so one step is easy to reproduce by hand."""
    spec = get_method(method)
    cfg = TrainConfig(optimizer="sgd", momentum=0.0, lr=0.1, batch_size=len(site.train), **train)
    method_cfg = method_cfg if method_cfg is not None else spec.config_cls()
    return spec.trainer_cls(model, site, cfg, method_cfg, spec.payload, torch.device("cpu"), log=lambda m: None)


def tiny_classifier(head_cls: type[nn.Linear] = nn.Linear, seed: int = 0) -> Classifier:
    """A seeded float64 Classifier: backbone tanh(Linear(4, 5)), then ``head_cls(5, 3)``."""
    torch.manual_seed(seed)
    return Classifier(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), head_cls(5, 3)).double()
