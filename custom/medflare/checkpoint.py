"""What a saved global model carries besides its weights: the facts inference needs.

FLARE's persistor keeps any top-level entry of a checkpoint besides ``"model"``; medflare adds ``"medflare"``
(:data:`FACTS_KEY`: method, model, task, normalisation, window, version), so a copied ``FL_global_model.pt`` still
says what it is. ``medflare predict`` reads them back (:func:`read_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import medflare
from medflare import readback
from medflare.errors import ConfigError
from medflare.readback import ANY, BOOL, INT, OBJECT, STR, Spec, obj

FACTS_KEY = "medflare"
FACTS_FORMAT = 1
MODEL_KEY = "model"  # FLARE's PTModelPersistenceFormatManager.PERSISTENCE_KEY_MODEL
# What predict reads of checkpoint_facts (the rest is informative); bounds of the task: readback.TASK_BOUNDS.
FACTS = obj(required={"method": STR, "model": STR,
                      "task": obj(required={"num_classes": INT, "in_channels": INT, "image_size": INT},
                                  optional={"class_names": Spec((list, type(None)), each=STR), "multi_label": BOOL})},
            optional={"format": INT, "medflare_version": STR, "job": STR, "method_args": obj(nullable=True),
                      "normalization": OBJECT, "window": STR, "server_model": BOOL, "private_keys": ANY})
SAVED_AS_IS = f"{readback.CHANGED}; use the model file as the run saved it, or rerun the job"


def normalization() -> dict[str, Any]:
    """How pixels become model input in this medflare (``data.transforms``)."""
    from medflare.data.transforms import NORMALISE_MEAN, NORMALISE_STD

    return {"mean": NORMALISE_MEAN, "std": NORMALISE_STD, "scale": "uint8 / 255; deeper images as float in [0, 1]"}


def checkpoint_facts(plan: Any) -> dict[str, Any]:
    """The facts a job's global model carries (plain JSON types, safe for ``torch.load(weights_only=True)``), from
    its :class:`~medflare.plan.RunPlan` (the task with class names when the data or ``task.class_names`` gave
    them)."""
    spec = plan.spec
    task = plan.task
    return {
        "format": FACTS_FORMAT,
        "medflare_version": medflare.__version__,
        "job": plan.job_name,
        "method": plan.method,
        "method_args": dict(plan.method_args),
        "model": plan.model,
        "task": {"num_classes": task.num_classes, "in_channels": task.in_channels, "image_size": task.image_size,
                 "class_names": list(task.class_names) if task.class_names else None,
                 "multi_label": bool(getattr(task, "multi_label", False))},
        "normalization": normalization(),
        "window": str(plan.data.get("window") or ""),
        "server_model": spec.server_model,
        "private_keys": spec.payload.private_keys,
        **({"dp_sgd": dict(plan.dp_sgd)} if plan.dp_sgd else {}),  # its GroupNorm architecture
    }


@dataclass
class Checkpoint:
    """A global model file read back: the state dict FLARE saved and :func:`checkpoint_facts` as saved."""

    path: Path
    weights: Mapping[str, Any]
    facts: dict[str, Any]

    @property
    def class_names(self) -> list[str]:
        """The task's class names, or ``class_<k>`` where the run had none."""
        task = self.facts["task"]
        return list(task.get("class_names") or [f"class_{k}" for k in range(int(task["num_classes"]))])


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Load a ``FL_global_model.pt`` / ``best_FL_global_model.pt`` with its facts (tensors only, no pickled code),
    held to :data:`FACTS` and :data:`readback.TASK_BOUNDS` with finite weights before anything is built.

    Raises:
        ConfigError: the file is missing, pickled or not a torch file, carries no medflare facts, or its facts or
            weights are implausible (one line naming the field or weight).
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint not found: {path}; give a run's FL_global_model.pt or best_FL_global_model.pt")
    content = readback.load_torch_weights(path, ConfigError)
    facts = content.get(FACTS_KEY) if isinstance(content, dict) else None
    if not isinstance(facts, dict) or not isinstance(content.get(MODEL_KEY), Mapping):
        raise ConfigError(f"{path} carries no medflare facts (method, task, normalisation): it is not a medflare "
                          "global model, or it was saved before checkpoints carried them; rerun the job with this "
                          "medflare")
    readback.check(facts, FACTS, f"{path} (facts under '{FACTS_KEY}')", ConfigError, SAVED_AS_IS)
    task = facts["task"]
    readback.check_task_facts(task, str(path), ConfigError)
    if task.get("class_names") is not None and len(task["class_names"]) != task["num_classes"]:
        raise ConfigError(f"{path}: task.class_names names {len(task['class_names'])} classes for task.num_classes="
                          f"{task['num_classes']}; {SAVED_AS_IS}")
    weights = content[MODEL_KEY]
    not_tensor = next((key for key, value in weights.items() if not isinstance(value, torch.Tensor)), None)
    if not_tensor is not None:
        raise ConfigError(f"{path}: model entry '{not_tensor}' is not a tensor; {SAVED_AS_IS}")
    readback.check_finite(weights, str(path), ConfigError)
    return Checkpoint(path, weights, facts)
