"""Model registry: one decorated entry function per model name, looked up by the factory and the tests."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from medflare.errors import ConfigError
from medflare.models.classifier import Classifier

__all__ = ["ModelEntrypoint", "ModelInfo", "get_model_info", "is_model", "list_models", "register_model"]


class ModelEntrypoint(Protocol):
    """Builds a randomly initialised :class:`Classifier`; every registered function has this signature."""

    def __call__(self, *, num_classes: int, in_channels: int, image_size: int) -> Classifier: ...


#: Returns a state dict in the Classifier layout (``backbone.*`` and, optionally, ``head.*``).
ImagenetWeightsLoader = Callable[[], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class ModelInfo:
    """A registered model.

    Attributes:
        name: registry key.
        entrypoint: builder of a randomly initialised model.
        module: module that registered it.
        imagenet_weights: loader of offline ImageNet weights, or None when the model has none shipped.
    """

    name: str
    entrypoint: ModelEntrypoint
    module: str
    imagenet_weights: ImagenetWeightsLoader | None = None


_MODELS: dict[str, ModelInfo] = {}


def register_model(
    name: str, *, imagenet_weights: ImagenetWeightsLoader | None = None
) -> Callable[[ModelEntrypoint], ModelEntrypoint]:
    """Decorator that registers a model entry function under ``name``.

    Args:
        name: registry key; registering it twice is an error.
        imagenet_weights: loader of ImageNet weights available offline, if the model has any.

    Raises:
        ConfigError: if ``name`` is already registered.
    """

    def decorate(entrypoint: ModelEntrypoint) -> ModelEntrypoint:
        if name in _MODELS:
            first = _MODELS[name].module
            raise ConfigError(f"model '{name}' is registered twice (by {first} and {entrypoint.__module__})")
        _MODELS[name] = ModelInfo(name, entrypoint, entrypoint.__module__, imagenet_weights)
        return entrypoint

    return decorate


def list_models(pattern: str | None = None) -> list[str]:
    """Registered model names, sorted, optionally filtered by a shell-style pattern such as ``"resnet*"``."""
    names = sorted(_MODELS)
    return names if pattern is None else fnmatch.filter(names, pattern)


def is_model(name: str) -> bool:
    """Whether ``name`` is registered."""
    return name in _MODELS


def get_model_info(name: str) -> ModelInfo:
    """The registry entry of ``name``.

    Raises:
        ConfigError: if the name is unknown; the message lists the registered models.
    """
    if name not in _MODELS:
        raise ConfigError(f"unknown model '{name}'; registered models: {', '.join(list_models())}")
    return _MODELS[name]
