"""Named experiment set-ups (TOML presets) that any method can run under: ``--scenario NAME``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medflare.config import load_config_file
from medflare.errors import ConfigError

SCENARIO_DIR = Path(__file__).parent


def list_scenarios() -> list[str]:
    """Names of the packaged scenarios (file names with '_' shown as '-')."""
    return sorted(p.stem.replace("_", "-") for p in SCENARIO_DIR.glob("*.toml"))


def load_scenario(name: str) -> dict[str, Any]:
    """The run options of a scenario, as a dict for the run configuration."""
    path = SCENARIO_DIR / f"{name.replace('-', '_')}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown scenario '{name}'; available: {', '.join(list_scenarios())}")
    return load_config_file(path)
