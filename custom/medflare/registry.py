"""The methods registry: one ``register_method`` call per method folder, looked up by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from medflare.errors import ConfigError

if TYPE_CHECKING:  # importing methods.base here would make method folders import a half-built registry
    from medflare.methods.base import MethodSpec

_METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method; a second method with the same name is a programming error."""
    if spec.name in _METHODS:
        raise ValueError(f"method '{spec.name}' is registered twice")
    _METHODS[spec.name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    """The spec of a registered method, or a ConfigError listing what exists."""
    _load_builtin_methods()
    if name not in _METHODS:
        raise ConfigError(f"unknown method '{name}'; registered methods: {', '.join(list_methods())}")
    return _METHODS[name]


def list_methods() -> list[str]:
    """Registered method names, sorted."""
    _load_builtin_methods()
    return sorted(_METHODS)


def _load_builtin_methods() -> None:
    import medflare.methods  # noqa: F401  (importing it runs the one registration line per method)
