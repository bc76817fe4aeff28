"""The server's initial global model by the path a job names, built without FLARE by :mod:`medflare.server_setup`."""

from __future__ import annotations

from torch import nn

from medflare.plan import RunPlan
from medflare.server_setup import global_model

build_global_model = global_model  # the initial global network, by the name callers import


def global_model_of(plan: RunPlan) -> nn.Module:
    """The initial global network of a job's ``plan`` (the persistor's, and the in-process loop's)."""
    task = plan.task
    return global_model(plan.method, plan.model, task.num_classes, task.in_channels, task.image_size, plan.pretrained,
                        plan.method_args, plan.seed, list(plan.plugins), bool(plan.dp_sgd))
