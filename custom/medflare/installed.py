"""Entry points of installed packages: how a package a site installed adds models and data sources to medflare.

A package declares them in its ``pyproject.toml``, e.g.
``[project.entry-points."medflare.models"] tiny_net = "my_models.tiny_net:tiny_net"``. The registries
(``medflare.models``, ``medflare.data.plugins``) list the names without importing anything and import one only
when a job uses it, so what runs is what the site's administrators installed; a job can only name it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from medflare.errors import ConfigError

__all__ = ["forget_installed", "installed_entry_points", "load_entry_point"]


@functools.lru_cache(maxsize=None)
def installed_entry_points(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` that installed packages declare, by name (scanned once per process)."""
    return {entry.name: entry for entry in entry_points(group=group)}


def forget_installed() -> None:
    """Scan the installed packages again on the next lookup (e.g. after a ``pip install`` in this process)."""
    installed_entry_points.cache_clear()


def load_entry_point(entry: EntryPoint, what: str, signature: str) -> Callable[..., Any]:
    """Import the function an entry point names; ConfigError, naming ``what`` it provides and the ``signature``
    it must have, when it cannot be imported or is not callable."""
    origin = f"entry point '{entry.name} = {entry.value}' of {describe_origin(entry)}"
    try:
        target = entry.load()
    except Exception as exc:  # whatever the package raises on import
        raise ConfigError(f"{what}: cannot import the {origin}: {type(exc).__name__}: {exc}") from exc
    if not callable(target):
        raise ConfigError(f"{what}: the {origin} names a {type(target).__name__}, not a function {signature}")
    return target


def describe_origin(entry: EntryPoint) -> str:
    """The installed distribution that declares ``entry``, for messages."""
    dist = entry.dist
    return f"package '{dist.name}' {dist.version}" if dist is not None else "an installed package"
