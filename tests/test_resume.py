"""Resuming a run: what the CLI checks before anything starts, what history the resumed job carries on, and the
model fingerprint it records (the simulator test resumes a real run)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from medflare import resume
from medflare.errors import ConfigError
from medflare.flare.models import build_global_model
from medflare.run_config import RunConfig

TASK = {"num_classes": 3, "in_channels": 1, "image_size": 28}


def previous_run(folder: Path, rounds: int = 2, stage: str = "train", method: str = "fedavg",
                 num_classes: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"round": r, "stage": stage, "wall_seconds": 1.0} for r in range(rounds)]
    results = {"method": method, "num_rounds": rounds, "rounds": records, "evaluations": {"0": {}},
               "best": {"model_version": 1, "balanced_accuracy": 0.5}, "final": {"model_version": rounds},
               "finished_at": 1.0}
    (folder / resume.RESULTS_FILE).write_text(json.dumps(results))
    model = build_global_model("fedavg", "cnn", num_classes, 1, 28)
    torch.save({"model": model.state_dict(), "train_conf": {}}, folder / resume.MODEL_FILE)
    return folder


def run_with(rounds: int, method: str = "fedavg") -> RunConfig:
    return RunConfig(method=method, rounds=rounds, task=dict(TASK))


def test_a_matching_run_with_more_rounds_resumes_from_the_absolute_folder(tmp_path: Path, monkeypatch) -> None:
    previous_run(tmp_path / "prev")
    monkeypatch.chdir(tmp_path)
    assert resume.check_resumable(run_with(5), "prev") == (tmp_path / "prev").resolve()


@pytest.mark.parametrize("case,message", [
    ("same_rounds", "already has 2 round(s); --rounds is the total"),
    ("other_method", "is a 'fedprox' run, not 'fedavg'"),
    ("other_task", "does not hold this run's 'cnn' model for this task"),
    ("other_stage", "was stage 'pretrain', but with 5 rounds it would be 'train'"),
    ("no_model", "FL_global_model.pt not found"),
    ("no_server_model", "keeps no global model on the server"),
])
def test_what_cannot_be_resumed_is_refused_in_one_line(tmp_path: Path, case: str, message: str) -> None:
    folder = previous_run(tmp_path / "prev", method="fedprox" if case == "other_method" else "fedavg",
                          num_classes=4 if case == "other_task" else 3,
                          stage="pretrain" if case == "other_stage" else "train")
    if case == "no_model":
        (folder / resume.MODEL_FILE).unlink()
    run = run_with(2 if case == "same_rounds" else 5, "local-only" if case == "no_server_model" else "fedavg")
    with pytest.raises(ConfigError, match="--resume") as error:
        resume.check_resumable(run, folder)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_run_config_validation_checks_the_resume_folder(tmp_path: Path) -> None:
    run = run_with(2)
    run.resume_from = str(previous_run(tmp_path / "prev"))
    with pytest.raises(ConfigError, match="already has 2 round"):
        run.validate()


def test_the_resumed_history_keeps_rounds_and_best_and_drops_the_old_ending() -> None:
    history = {"method": "fedavg", "num_rounds": 2, "rounds": [{"round": 0}, {"round": 1}], "evaluations": {"2": {}},
               "best": {"model_version": 1, "balanced_accuracy": 0.5}, "final": {}, "finished_at": 9.0,
               "stopped_early": {"after_round": 2}, "resumed": [{"start_round": 1}]}
    fresh = {"method": "fedavg", "num_rounds": 5, "controller_started_at": 10.0, "rounds": [], "evaluations": {}}
    continued = resume.continued_results(history, fresh, {"start_round": 2})
    assert continued["rounds"] == history["rounds"] and continued["evaluations"] == history["evaluations"]
    assert continued["num_rounds"] == 5 and continued["controller_started_at"] == 10.0
    assert continued["best"] == history["best"] and resume.best_score(history, "balanced_accuracy") == 0.5
    assert not {"final", "finished_at", "stopped_early"} & set(continued)
    assert [r["start_round"] for r in continued["resumed"]] == [1, 2]


def test_model_digest_changes_with_any_value_name_or_dtype() -> None:
    params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.int64)}
    digest = resume.model_digest(params)
    assert resume.model_digest({k: v.copy() for k, v in reversed(list(params.items()))}) == digest
    changed = {**params, "a": params["a"].copy()}
    changed["a"][1, 2] += 1e-6
    assert resume.model_digest(changed) != digest
    assert resume.model_digest({**params, "a": params["a"].astype(np.float64)}) != digest
    assert resume.model_digest({"c": params["a"], "b": params["b"]}) != digest
