"""Resuming a run: continue a stopped or finished job from its last global model and its round counter.

A resumable folder (any ``medflare run`` folder, or a downloaded job's ``workspace/app_server``) holds
``medflare_results.json`` and ``FL_global_model.pt``; the new job's controller continues the history and the
persistor loads the model, so the results cover every round. The *server* reads the folder (in production: a path
on the server machine). What stays at the sites (optimizer state, personal heads) starts afresh.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from medflare import readback
from medflare.errors import ConfigError

RESULTS_FILE = "medflare_results.json"
MODEL_FILE = "FL_global_model.pt"
BEST_MODEL_FILE = "best_FL_global_model.pt"
# what belongs to the end of the previous job and not to the resumed history
ENDING_KEYS = ("final", "final_validation", "finished_at", "stopped_early", "error")
HISTORY_KEYS = ("rounds", "evaluations")  # continued from the previous job, never restarted
UNUSABLE = f"{readback.CHANGED}; resume from the folder as medflare wrote it (or a copy of it), or start a new run"


def read_history(folder: str | Path) -> dict[str, Any]:
    """The previous job's ``medflare_results.json`` in ``folder``, held to :data:`readback.RESULTS`; ConfigError
    when it or the global model is missing, or it is unreadable or off the schema."""
    folder = Path(folder)
    results, model = folder / RESULTS_FILE, folder / MODEL_FILE
    for path in (results, model):
        if not path.is_file():
            raise ConfigError(f"--resume: {path} not found; give a medflare run folder (or a downloaded job's "
                              f"workspace/app_server) that holds {RESULTS_FILE} and {MODEL_FILE}")
    history = readback.load_json(results, ConfigError, "--resume: ", UNUSABLE)
    return readback.check(history, readback.RESULTS, f"--resume: {results}", ConfigError, UNUSABLE)


def read_model(folder: str | Path) -> dict[str, np.ndarray]:
    """The global model FLARE's persistor saved in ``folder`` (tensors only: never unpickles code); ConfigError
    when it is missing, unreadable, holds no tensors or non-finite weights."""
    path = Path(folder) / MODEL_FILE
    saved = readback.load_torch_weights(path, ConfigError, "--resume: ")
    saved = saved.get("model", saved) if isinstance(saved, dict) else None
    if not isinstance(saved, Mapping):
        raise ConfigError(f"--resume: {path} holds no model weights (a dict of tensors under 'model'); {UNUSABLE}")
    readback.check_finite(saved, f"--resume: {path}", ConfigError)
    return {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in saved.items()}


def continued_results(history: Mapping[str, Any], fresh: Mapping[str, Any], start: Mapping[str, Any]) -> dict[str, Any]:
    """The results a resumed job starts from: ``history``'s rounds, evaluations and best model under the new
    controller's header (``fresh``), with ``start`` (:func:`start_record`) appended to ``resumed``."""
    carried = {key: value for key, value in history.items() if key not in ENDING_KEYS}
    header = {key: value for key, value in fresh.items() if key not in HISTORY_KEYS}
    return {**carried, **header, "resumed": [*history.get("resumed", []), dict(start)]}


def best_score(history: Mapping[str, Any], key_metric: str) -> float:
    """The best validation score of the previous job (-inf when it had none), so best-model selection and
    early stopping continue where they were."""
    value = history.get("best", {}).get(key_metric)
    return float(value) if isinstance(value, (int, float)) else -np.inf


def model_digest(params: Mapping[str, Any]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and values (a fingerprint of exactly these weights)."""
    digest = hashlib.sha256()
    for key in sorted(params):
        array = np.ascontiguousarray(np.asarray(params[key]))
        digest.update(f"{key}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def start_record(folder: str | Path, start_round: int, params: Mapping[str, Any]) -> dict[str, Any]:
    """What the resumed job records about its start: the folder, the round it continues from, and the digest
    of the global model it loaded."""
    return {"from": str(folder), "start_round": start_round, "at": time.time(),
            "initial_model_digest": model_digest(params)}


def check_resumable(plan: Any, folder: str | Path) -> Path:
    """Check, before anything starts, that ``plan`` (its rounds the total) can continue the job in ``folder``: same
    method, a global model of the same keys and shapes, fewer rounds done, the same stage for each. Returns the
    absolute folder (what the server reads); ConfigError: one line saying what does not match."""
    folder = Path(folder).resolve()
    history = read_history(folder)
    if not plan.spec.server_model:
        raise ConfigError(f"--resume: '{plan.method}' keeps no global model on the server, so there is nothing to "
                          "resume from; start a new run")
    if history.get("method") != plan.method:
        raise ConfigError(f"--resume: {folder} is a '{history.get('method')}' run, not '{plan.method}'")
    done, total = len(history["rounds"]), len(plan.rounds)
    if total <= done:
        raise ConfigError(f"--resume: {folder} already has {done} round(s); --rounds is the total, so give more "
                          f"than {done} (e.g. --rounds {done + max(total, 1)})")
    for record, planned in zip(history["rounds"], plan.rounds):
        if record.get("stage", planned.stage) != planned.stage:
            raise ConfigError(f"--resume: round {record['round'] + 1} of {folder} was stage '{record['stage']}', but "
                              f"with {total} rounds it would be '{planned.stage}'; keep the stage lengths unchanged")
    _check_model(plan, folder / MODEL_FILE)
    return folder


def _check_model(plan: Any, checkpoint: Path) -> None:
    """The checkpoint must hold exactly the keys and shapes of this run's global model."""
    from dataclasses import replace

    from medflare.server_setup import global_model

    expected = global_model(replace(plan.network, pretrained=None)).state_dict()  # keys and shapes
    saved = read_model(checkpoint.parent)
    shapes = {k: tuple(np.shape(v)) for k, v in saved.items()}
    wanted = {k: tuple(v.shape) for k, v in expected.items()}
    if shapes != wanted:
        differing = sorted(set(shapes.items()) ^ set(wanted.items()))[:3]
        raise ConfigError(f"--resume: {checkpoint} does not hold this run's '{plan.model}' model for this task "
                          f"(differs in {differing}); resume with the model and data of the previous run")
