"""The methods registry: medflare's own methods (one ``builtin_method`` call per method) and those a job's plugins
register (``register_method``), looked up by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from medflare.errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # importing it imports every method, and torch: only a lookup does
    from medflare.methods.base import MethodSpec

_PLUGINS: dict[str, MethodSpec] = {}  # methods from outside medflare.methods (a job's plugins, tests), by name


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method from outside medflare (a job's plugin, a test); a name already taken is a programming error."""
    if spec.name in _registered():
        raise ValueError(f"method '{spec.name}' is registered twice")
    _PLUGINS[spec.name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    """The spec of a registered method, or a ConfigError listing what exists."""
    methods = _registered()
    if name not in methods:
        raise ConfigError(f"unknown method '{name}'{did_you_mean(name, methods)}; registered methods: "
                          f"{', '.join(sorted(methods))}")
    return methods[name]


def list_methods(plugins: bool = False) -> list[str]:
    """Registered method names, sorted: the built-in ones, and with ``plugins`` also those a job's plugins
    registered in this process (apps, templates and docs list the built-in ones only)."""
    return sorted(name for name in _registered() if plugins or name not in _PLUGINS)


def _registered() -> dict[str, MethodSpec]:
    """Every method by name: medflare's own (importing methods.base first runs medflare.methods, whose folders
    each declare theirs with ``builtin_method``), then the plugins'."""
    from medflare.methods.base import BUILTIN_METHODS

    return {**{spec.name: spec for spec in BUILTIN_METHODS}, **_PLUGINS}


PLUGIN_PACKAGE = "medflare_plugins"  # a job's own methods ship as app/custom/medflare_plugins/<name>.py (BYOC)


def load_plugins(modules: list[str]) -> None:
    """Import a job's plugin modules (each registers its methods with :func:`register_method`); ConfigError for
    a module outside ``medflare_plugins``, which is never installed, so plugins exist only in a BYOC job."""
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
