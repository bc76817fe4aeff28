"""The server's initial global model of a job's plan, built without FLARE by :mod:`medflare.server_setup`."""

from __future__ import annotations

from torch import nn

from medflare.plan import RunPlan
from medflare.server_setup import global_model


def global_model_of(plan: RunPlan) -> nn.Module:
    """The initial global network of a job's ``plan`` (the persistor's, and the in-process loop's)."""
    return global_model(plan.network)
