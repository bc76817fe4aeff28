"""Tiny fake site data and models so method tests need neither FLARE nor the data layer."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset


def make_site(num_classes: int = 3, n: int = 12, features: int = 4, seed: int = 0, labels=None) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator, dtype=torch.float64)
    y = torch.as_tensor(labels if labels is not None else np.arange(n) % num_classes, dtype=torch.long)
    dataset = TensorDataset(x, y)
    counts = np.bincount(y[y >= 0].numpy(), minlength=num_classes)
    return SimpleNamespace(train=dataset, val=dataset, test=dataset, num_classes=num_classes, class_counts=counts)


@pytest.fixture
def site() -> SimpleNamespace:
    return make_site()


@pytest.fixture
def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).double()
