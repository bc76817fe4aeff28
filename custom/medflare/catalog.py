"""What the listing commands print, read without importing torch: ``medflare methods``, ``medflare models`` and the
partition schemes ``--help`` names.

The registries behind them import every method and network, so torch and torchvision: seconds before one line
appears. ``catalog.json`` is a snapshot of what the registries say (methods with their summaries and presets,
models with their parameter counts, the partition schemes). It is generated from them, never written by hand:
``tests/test_catalog.py`` rebuilds it and fails when it differs, and ``python -m medflare.catalog`` rewrites it.
What a snapshot cannot know is looked up live: whether a model's ImageNet weights package is installed here, and
models that installed packages declare.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from medflare.installed import installed_entry_points

CATALOG_FILE = Path(__file__).with_name("catalog.json")
# The task parameters are counted for: RGB input and a binary head (other tasks change only the stem and the head)
COUNTED_TASK = {"num_classes": 2, "in_channels": 3}
# Image sides parameters are counted at: MedMNIST's 28 px and ImageNet's 224 px. A model whose count differs
# between them (a ViT: position embeddings per patch) is built for one image size, task.image_size.
COUNTED_SIZES = (28, 224)
SMALLEST_SIDE = 28  # every registered model is tested at 28 x 28 (tests/models); the convolutional ones take more


@lru_cache(maxsize=1)
def load_catalog() -> dict[str, Any]:
    """The snapshot in ``catalog.json``; rebuilt from the registries (seconds) when the file is missing."""
    if not CATALOG_FILE.is_file():
        return build_catalog()
    return json.loads(CATALOG_FILE.read_text())


def build_catalog() -> dict[str, Any]:
    """The catalog from the registries themselves (imports every method and model)."""
    from medflare.data.partition import SCHEME_FORMS
    from medflare.models import ENTRY_POINT_GROUP

    return {"methods": method_entries(), "models": model_entries(), "partitions": list(SCHEME_FORMS),
            "model_entry_point_group": ENTRY_POINT_GROUP}


def method_entries() -> list[dict[str, Any]]:
    """Every built-in method: name, one-line summary and preset names."""
    from medflare.registry import get_method, list_methods

    return [{"name": name, "summary": get_method(name).summary, "presets": list(get_method(name).presets)}
            for name in list_methods()]


def model_entries() -> list[dict[str, Any]]:
    """Every model medflare registers itself: parameters at each counted size, and whether it has ImageNet weights
    (and which importable package ships them)."""
    from medflare.models import get_model_info

    entries = []
    for name in own_models():
        info = get_model_info(name)
        entries.append({"name": name, "params": {str(size): parameter_count(name, size) for size in COUNTED_SIZES},
                        "imagenet_package": info.imagenet_package if info.imagenet_weights else None})
    return entries


def own_models() -> list[str]:
    """The models medflare's own family modules register (not a plugin's, a test's or an installed package's)."""
    from medflare.models import ENTRY_POINT_GROUP, get_model_info, list_models

    installed = installed_entry_points(ENTRY_POINT_GROUP)
    return [name for name in list_models()
            if name not in installed and get_model_info(name).module.startswith("medflare.models.")]


def parameter_count(name: str, image_size: int) -> int:
    """Parameters of model ``name`` for :data:`COUNTED_TASK` at ``image_size``, counted on torch's meta device
    (shapes only: no memory, no initialisation cost)."""
    import torch

    from medflare.models import get_model_info

    with torch.device("meta"):
        model = get_model_info(name).entrypoint(**COUNTED_TASK, image_size=image_size)
    return sum(parameter.numel() for parameter in model.parameters())


def installed_models() -> list[str]:
    """Models that installed packages declare (entry points), listed without importing them (as the registry
    lists them: :mod:`medflare.installed`)."""
    return sorted(installed_entry_points(load_catalog()["model_entry_point_group"]))


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found without importing it)."""
    return importlib.util.find_spec(module) is not None


def write_catalog(path: Path = CATALOG_FILE) -> None:
    """Regenerate ``catalog.json`` from the registries, one entry a line (reviewable diffs)."""
    sections = []
    for key, value in build_catalog().items():
        body = ",\n".join(f"  {json.dumps(item)}" for item in value) if isinstance(value, list) else None
        sections.append(f' "{key}": [\n{body}\n ]' if body is not None else f' "{key}": {json.dumps(value)}')
    path.write_text("{\n" + ",\n".join(sections) + "\n}\n")


if __name__ == "__main__":
    write_catalog()
    print(f"wrote {CATALOG_FILE}", file=sys.stderr)
