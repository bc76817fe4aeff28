"""The server's initial global model by the path a job names, built without FLARE by :mod:`medflare.server_setup`."""

from __future__ import annotations

from torch import nn

from medflare.plan import RunPlan
from medflare.server_setup import global_model


def build_global_model(method: str, model: str, num_classes: int, in_channels: int, image_size: int,
                       pretrained: str | None = None, method_args: dict | None = None, seed: int = 0,
                       plugins: list | None = None, dp_sgd: bool = False) -> nn.Module:
    """Initial global network; FLARE's PTFileModelPersistor instantiates it from the job config
    (:func:`medflare.server_setup.global_model`)."""
    return global_model(method, model, num_classes, in_channels, image_size, pretrained, method_args, seed, plugins,
                        dp_sgd)


def global_model_of(plan: RunPlan) -> nn.Module:
    """The initial global network of a job's ``plan`` (the persistor's, and the in-process loop's)."""
    task = plan.task
    return global_model(plan.method, plan.model, task.num_classes, task.in_channels, task.image_size, plan.pretrained,
                        plan.method_args, plan.seed, list(plan.plugins), bool(plan.dp_sgd))
