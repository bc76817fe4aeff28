"""The methods registry: one ``register_method`` call per method folder, looked up by name."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from medflare.errors import ConfigError

if TYPE_CHECKING:  # importing methods.base here would make method folders import a half-built registry
    from medflare.methods.base import MethodSpec

_METHODS: dict[str, MethodSpec] = {}
_PLUGINS: set[str] = set()  # methods registered from outside medflare.methods (a job's plugins, tests)


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method; a second method with the same name is a programming error."""
    if spec.name in _METHODS:
        raise ValueError(f"method '{spec.name}' is registered twice")
    _METHODS[spec.name] = spec
    if not str(sys._getframe(1).f_globals.get("__name__", "")).startswith("medflare.methods."):
        _PLUGINS.add(spec.name)
    return spec


def get_method(name: str) -> MethodSpec:
    """The spec of a registered method, or a ConfigError listing what exists."""
    _load_builtin_methods()
    if name not in _METHODS:
        raise ConfigError(f"unknown method '{name}'; registered methods: {', '.join(list_methods(plugins=True))}")
    return _METHODS[name]


def list_methods(plugins: bool = False) -> list[str]:
    """Registered method names, sorted: the built-in ones, and with ``plugins`` also those a job's plugins
    registered in this process (apps, templates and docs list the built-in ones only)."""
    _load_builtin_methods()
    return sorted(name for name in _METHODS if plugins or name not in _PLUGINS)


def _load_builtin_methods() -> None:
    import medflare.methods  # noqa: F401  (importing it runs the one registration line per method)


PLUGIN_PACKAGE = "medflare_plugins"  # a job's own methods ship as app/custom/medflare_plugins/<name>.py (BYOC)


def load_plugins(modules: list[str]) -> None:
    """Import a job's plugin modules, each of which registers its own methods with :func:`register_method`.

    Only modules of the ``medflare_plugins`` package are accepted: it is never installed, so plugins exist only
    in a job that carries its own code (BYOC), which a pre-installed site refuses.

    Raises:
        ConfigError: for a module outside that package or one that cannot be imported.
    """
    import importlib

    for module in modules:
        if not isinstance(module, str) or not module.startswith(PLUGIN_PACKAGE + "."):
            raise ConfigError(f"plugin '{module}' must be a module of the '{PLUGIN_PACKAGE}' package")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"cannot import plugin '{module}': {exc}. Plugins ship inside the job (BYOC); a site that only "
                "runs its installed medflare cannot load them"
            ) from exc
