"""Named run-configuration presets a method declares (``MethodSpec.presets``), e.g. ``--preset paper``. A preset is data
only: a run-config layer (top-level options such as ``model``, ``rounds``, ``clients``, and the sections ``data``,
``train``, ``method_args``) plus the list of what still differs from its source. It sits at the bottom of the run
configuration: RunConfig defaults <- preset <- --scenario <- --config <- flags <- --set, so every value a preset sets
can still be changed (``medflare.plan.preset_layer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

PAPER = "paper"  # the preset name of a method's published headline configuration
# The run-config keys a preset may set: what the paper fixes about the training, not where a run writes
PRESET_KEYS = ("model", "pretrained", "rounds", "clients", "site_model", "data", "train", "method_args", "task",
               "shot_thresholds", "site_evaluation")
# The keys a method shares with its baselines in `compare --preset` (everything but its own hyperparameters)
SHARED_KEYS = tuple(key for key in PRESET_KEYS if key != "method_args")


@dataclass(frozen=True)
class Preset:
    """One named configuration of a method."""

    overrides: Mapping[str, Any]  # the run-config layer (keys from PRESET_KEYS; the sections merge key by key)
    # what still differs from the source with this stack offline, one sentence each (printed before a run starts)
    differs: tuple[str, ...]
    source: str  # where the values come from (paper table, spec section)
    setting: str = ""  # the paper's setting these values are the headline of (e.g. "HyperKvasir, 8 clients")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.overrides) - set(PRESET_KEYS))
        if unknown:
            raise ValueError(f"preset keys {unknown} are not preset options ({', '.join(PRESET_KEYS)})")
        if not self.differs or not self.source:
            raise ValueError("a preset names its source and what still differs from it")

    def shared(self) -> dict[str, Any]:
        """The layer without the method's own hyperparameters: what a baseline compared with it takes."""
        return {key: value for key, value in self.overrides.items() if key in SHARED_KEYS}

    def describe(self, method: str, name: str) -> list[str]:
        """Lines the CLI prints before a run: the preset, its source, then each remaining difference."""
        where = f" ({self.setting})" if self.setting else ""
        return [f"preset '{name}' of {method}{where}, from {self.source}; still differs from it:",
                *(f"  - {line}" for line in self.differs)]
