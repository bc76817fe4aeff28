"""Typed configuration: dataclasses built from plain dicts with clear errors on unknown keys."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from medflare.errors import ConfigError

T = TypeVar("T")


def from_dict(cls: type[T], values: dict[str, Any] | None, where: str) -> T:
    """Build dataclass ``cls`` from ``values``; unknown keys raise ConfigError naming ``where``."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {unknown}; valid options: {sorted(fields)}")
    hints = get_type_hints(cls)
    coerced = {key: _coerce(value, hints.get(key), f"{where}.{key}") for key, value in values.items()}
    return cls(**coerced)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Accept ints for float fields and strings from the command line; reject bools posing as numbers."""
    if hint in (float, "float") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is bool and isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got '{value}'")
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or TOML run configuration."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: {file}")
    text = file.read_text()
    try:
        return tomllib.loads(text) if file.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot parse {file}: {exc}") from exc


def parse_value(text: str) -> Any:
    """Parse a command-line override value: JSON when it parses (numbers, true/false, lists), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
