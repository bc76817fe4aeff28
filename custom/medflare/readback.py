"""Reading back what medflare wrote: depth-limited JSON/TOML, small declarative schemas, model file checks.

A file medflare reads back (results, a site's ``medflare_site.json``, a model file, ``--pretrained`` weights) may
have been changed, cut short or crafted since. Each reader checks it here before anything is built, allocated or
launched, and a bad file becomes ONE line naming the file, the field and what to do.
"""

from __future__ import annotations

import json
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tomllib

from medflare.errors import DataError, MedflareError

# The deepest file medflare writes nests about 8 levels (results -> evaluations -> version -> extra -> name ->
# by_site -> site -> per_class_recall); 32 leaves room for new fields and refuses crafted nesting long before
# Python's recursion limit (about 1000) would turn it into a RecursionError.
MAX_DEPTH = 32
# Plausible tasks, (lowest, highest) inclusive. The lowest are run_config's; the highest keep a tampered file from
# sizing allocations: one 4096 x 4096 x 16 float image is 1 GiB, and no medical image source medflare reads has
# more than 16 channels (grey, RGB, a few MRI sequences) or a task more than 10,000 classes.
TASK_BOUNDS = {"num_classes": (2, 10_000), "in_channels": (1, 16), "image_size": (8, 4096)}
CHANGED = "it was changed or cut short after medflare wrote it"


@dataclass(frozen=True)
class Spec:
    """What one value must be: its accepted types (``bool`` is never taken for ``int``), the keys an object must
    and may have, and (``each``) the spec of every list item or of every object value not named."""

    types: tuple[type, ...]
    required: Mapping[str, Spec] = field(default_factory=dict)
    optional: Mapping[str, Spec] = field(default_factory=dict)
    each: Spec | None = None


def obj(required: Mapping[str, Spec] | None = None, optional: Mapping[str, Spec] | None = None,
        each: Spec | None = None, nullable: bool = False) -> Spec:
    """An object (JSON object, Python dict) with these keys; ``nullable``: or null."""
    return Spec((dict, type(None)) if nullable else (dict,), required or {}, optional or {}, each)


def list_of(item: Spec) -> Spec:
    """A list whose every item is ``item``."""
    return Spec((list,), each=item)


ANY = Spec((object,))
INT = Spec((int,))
NUMBER = Spec((int, float))
STR = Spec((str,))
BOOL = Spec((bool,))
OBJECT = obj()

# ----- the controller's medflare_results.json (flare/controller.py writes it, report.py and resume.py read it) ---
_SCORE = Spec((int, float, type(None)))
_SCORES = Spec((list, type(None)), each=_SCORE)
_METRICS = obj(optional={"balanced_accuracy": _SCORE, "per_class_recall": _SCORES, "per_class_auc": _SCORES})
_EVALUATION = obj(optional={"model_version": INT, "test": _METRICS, "val": OBJECT, "site_mean": OBJECT,
                            "by_site": obj(each=OBJECT), "test_by_attribute": obj(each=_METRICS),
                            "test_stats": OBJECT, "method_metrics": obj(nullable=True),
                            "extra": obj(each=obj(optional={"test": OBJECT, "site_mean": OBJECT,
                                                            "by_site": obj(each=OBJECT)}))})
_ROUND = obj(required={"round": INT, "started_at": NUMBER, "wall_seconds": NUMBER},
             optional={"stage": STR, "share": OBJECT, "failed": OBJECT, "rejected": OBJECT, "sites": obj(each=OBJECT),
                       "payload": obj(each=obj(required={"arrays": ANY, "meta_keys": ANY, "bytes": NUMBER}))})
RESULTS = obj(required={"method": STR, "rounds": list_of(_ROUND)},
              optional={"num_rounds": INT, "evaluations": obj(each=_EVALUATION), "final": _EVALUATION,
                        "best": obj(optional={"model_version": INT}, each=NUMBER), "final_validation": OBJECT,
                        "resumed": list_of(OBJECT), "controller_started_at": NUMBER, "finished_at": NUMBER,
                        "stopped_early": obj(nullable=True), "error": Spec((str, type(None))),
                        "plan": Spec((str, type(None)))})


def load_json(path: Path, error: type[MedflareError] = DataError, where: str = "", fix: str = "") -> Any:
    """The JSON (or, for a ``.toml`` file, TOML) content of ``path``, nested at most :data:`MAX_DEPTH` deep, else
    ``error`` (``where`` before the file name, ``fix`` appended: why and what to do)."""
    name = f"{where}{path}"
    try:
        text = path.read_text(encoding="utf-8")
        # CPython's parsers recurse per level and raise RecursionError near the interpreter's limit
        content = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise error(_line(f"{name} cannot be read ({exc})", fix)) from exc
    except (ValueError, tomllib.TOMLDecodeError) as exc:  # JSONDecodeError is a ValueError
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise error(_line(f"{name} is not valid {kind} ({exc})", fix)) from exc
    except RecursionError:
        raise error(_line(f"{name} nests deeper than {MAX_DEPTH} levels", fix)) from None
    if nesting_depth(content) > MAX_DEPTH:
        raise error(_line(f"{name} nests deeper than {MAX_DEPTH} levels", fix))
    return content


def nesting_depth(value: Any) -> int:
    """How many lists/objects deep ``value`` nests (0 for a scalar), counted without recursion and stopping
    once past :data:`MAX_DEPTH`."""
    deepest, pending = 0, [(value, 1)]
    while pending and deepest <= MAX_DEPTH:
        node, level = pending.pop()
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, (list, tuple)) else None
        if children is not None:
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in children)
    return deepest


def check(value: Any, spec: Spec, name: str, error: type[MedflareError] = DataError, fix: str = "") -> Any:
    """``value`` if it holds to ``spec``; else ``error`` naming ``name`` and the first field that does not."""
    if nesting_depth(value) > MAX_DEPTH:
        raise error(_line(f"{name} nests deeper than {MAX_DEPTH} levels", fix))
    pending: deque[tuple[Any, Spec, str]] = deque([(value, spec, "")])  # breadth first: fields in file order
    while pending:
        item, wanted, at = pending.popleft()
        if not _is_a(item, wanted.types):
            found = type(item).__name__
            raise error(_line(f"{name}: {at or 'the top level'} is {found}, not {_kinds(wanted)}", fix))
        pending.extend(_children(item, wanted, at, name, error, fix))
    return value


def _children(item: Any, wanted: Spec, at: str, name: str, error: type[MedflareError],
              fix: str) -> list[tuple[Any, Spec, str]]:
    """The parts of ``item`` that ``wanted`` says something about, with their specs and field paths."""
    if isinstance(item, list):
        return [(child, wanted.each, f"{at}[{i}]") for i, child in enumerate(item)] if wanted.each else []
    if not isinstance(item, Mapping):
        return []
    missing = next((key for key in wanted.required if key not in item), None)
    if missing is not None:
        field_name = f"{at}.{missing}" if at else missing
        raise error(_line(f"{name}: {field_name} is missing", fix))
    named = {**wanted.optional, **wanted.required}
    parts = []
    for key, child in item.items():
        child_spec = named.get(key, wanted.each)
        if child_spec is not None:
            parts.append((child, child_spec, f"{at}.{key}" if at else str(key)))
    return parts


def _is_a(value: Any, types: tuple[type, ...]) -> bool:
    # bool is an int subclass, but true is no round number or image size
    return isinstance(value, types) and (not isinstance(value, bool) or bool in types or object in types)


def _kinds(spec: Spec) -> str:
    names = {dict: "an object", list: "a list", int: "a whole number", float: "a number", str: "a string",
             bool: "true/false", type(None): "null"}
    kinds = [names.get(kind, kind.__name__) for kind in spec.types]
    return "a number" if set(spec.types) == {int, float} else " or ".join(kinds)


def _line(message: str, fix: str) -> str:
    """One line: the problem, then what to do."""
    return " ".join(f"{message}; {fix}".split()) if fix else " ".join(message.split())


# ----- model files ---------------------------------------------------------------------------------------------
def load_torch_weights(path: Path, error: type[MedflareError] = DataError, where: str = "") -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU: tensors and plain containers, never code (a pickled
    file is described, never how to unpickle it); ``error`` when it is missing, pickled or damaged."""
    import torch

    name = f"{where}{path}"
    if not path.is_file():
        raise error(f"{name} not found; give an existing .pt file")
    try:
        with warnings.catch_warnings():  # torch's advice on a file it then refuses (an old pickle's protocol, say):
            warnings.simplefilter("ignore")  # the one line below says what the file is and what to do
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types; its text advises weights_only=False
        if "Unsupported global" in str(exc):
            raise error(f"{name} is a pickled model file (Python objects, not a medflare weights-only file): loading "
                        "it can run code it carries, so medflare does not; export the model with medflare (a run's "
                        "FL_global_model.pt, or a state_dict saved with torch.save), or load it only if you trust "
                        "it, with your own code") from None
        raise error(f"{name} is not a readable PyTorch weights file (damaged, cut short, or another format: "
                    f"{type(exc).__name__}); give a file saved with torch.save, e.g. a run's FL_global_model.pt"
                    ) from None


def check_finite(weights: Mapping[str, Any], name: str, error: type[MedflareError] = DataError) -> None:
    """``error`` naming the first float tensor/array of ``weights`` that holds a NaN or an infinity."""
    for key, value in weights.items():
        array = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        if np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.complexfloating):
            if not np.isfinite(array).all():
                raise error(f"{name}: weight '{key}' holds NaN or infinite values, so every score of this model "
                            "would be meaningless; use an earlier model of the run (e.g. best_FL_global_model.pt) "
                            "or retrain, with a lower learning rate if training diverged")


def check_task_facts(task: Mapping[str, Any], name: str, error: type[MedflareError] = DataError) -> None:
    """``error`` naming the field, value and range when a task fact a model is built from is outside
    :data:`TASK_BOUNDS` (checked before anything is allocated)."""
    for key, (lowest, highest) in TASK_BOUNDS.items():
        value = task.get(key)
        if not _is_a(value, (int,)) or not lowest <= value <= highest:
            raise error(f"{name}: task.{key} is {value!r}, not a whole number in {lowest}..{highest}: {CHANGED}; "
                        "use the model file as the run saved it")
