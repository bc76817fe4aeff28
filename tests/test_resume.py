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
from medflare.plan import RunPlan, build_global_model, resolve
from medflare.run_config import RunConfig

from ._plans import run_plan

TASK = {"num_classes": 3, "in_channels": 1, "image_size": 28}


def previous_run(folder: Path, rounds: int = 2, stage: str = "train", method: str = "fedavg",
                 num_classes: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"round": r, "stage": stage, "started_at": 10.0 * r, "wall_seconds": 1.0} for r in range(rounds)]
    results = {"method": method, "num_rounds": rounds, "rounds": records, "evaluations": {"0": {}},
               "best": {"model_version": 1, "balanced_accuracy": 0.5}, "final": {"model_version": rounds},
               "finished_at": 1.0}
    (folder / resume.RESULTS_FILE).write_text(json.dumps(results))
    model = build_global_model("fedavg", "cnn", num_classes, 1, 28)
    torch.save({"model": model.state_dict(), "train_conf": {}}, folder / resume.MODEL_FILE)
    return folder


def run_with(rounds: int, method: str = "fedavg") -> RunPlan:
    """The plan of a resumed run of ``rounds`` rounds in all."""
    return run_plan(RunConfig(method=method, rounds=rounds, task=dict(TASK)))


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


def test_a_simulation_checks_the_resume_folder_before_anything_is_written(tmp_path: Path) -> None:
    from medflare.console.simulate import run_simulation

    run = RunConfig(method="fedavg", rounds=2, task=dict(TASK), data={"source": "synthetic:classes=3,channels=1"},
                    resume_from=str(previous_run(tmp_path / "prev")))
    with pytest.raises(ConfigError, match="already has 2 round"):
        run_simulation(resolve(run, "byoc"), tmp_path / "out", echo=lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev"]


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


# ----- a tampered run folder: one line naming the file and the field, before anything starts ------------------
def tampered_results(folder: Path, change) -> Path:
    """Let ``change`` edit the folder's results (a dict) in place, or return the text to write instead."""
    path = folder / resume.RESULTS_FILE
    results = json.loads(path.read_text())
    replaced = change(results)
    path.write_text(replaced if isinstance(replaced, str) else json.dumps(results))
    return path


@pytest.mark.parametrize("change,field", [
    (lambda r: "[" * 100_000 + "]" * 100_000, "nests deeper than"),  # before: RecursionError
    (lambda r: r["rounds"][0].pop("started_at"), "rounds[0].started_at is missing"),  # before: KeyError in the report
    (lambda r: r.update(rounds=["a", "b"]), "rounds[0] is str, not an object"),  # before: AttributeError
    (lambda r: r.update(best=[1]), "best is list, not an object"),  # before: AttributeError in the controller
    (lambda r: r.update(resumed=5), "resumed is int, not a list"),  # before: TypeError in the controller
    (lambda r: r.update(method=None), "method is NoneType, not a string"),
    (lambda r: json.dumps(r)[:40], "is not valid JSON"),  # cut short
])
def test_a_tampered_results_file_is_refused_in_one_line(tmp_path: Path, change, field: str) -> None:
    results = tampered_results(previous_run(tmp_path / "prev"), change)
    with pytest.raises(ConfigError) as error:
        resume.check_resumable(run_with(5), tmp_path / "prev")
    assert f"--resume: {results}" in str(error.value) and field in str(error.value)
    assert "\n" not in str(error.value) and "start a new run" in str(error.value)


def test_a_nan_global_model_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    """Before: every check passed, and the run failed 113 s later with 'only 0 site(s) sent a valid result'."""
    folder = previous_run(tmp_path / "prev")
    saved = torch.load(folder / resume.MODEL_FILE, weights_only=True)
    key = next(k for k, v in saved["model"].items() if v.is_floating_point())
    saved["model"][key].view(-1)[3] = float("inf")
    torch.save(saved, folder / resume.MODEL_FILE)
    for read in (lambda: resume.check_resumable(run_with(5), folder), lambda: resume.read_model(folder)):
        with pytest.raises(ConfigError) as error:  # the CLI's check and the server's own read
            read()
        assert f"'{key}'" in str(error.value) and "NaN or infinite" in str(error.value) and "\n" not in str(error.value)


def test_a_pickled_global_model_is_named_as_such(tmp_path: Path) -> None:
    folder = previous_run(tmp_path / "prev")
    torch.save(build_global_model("fedavg", "cnn", 3, 1, 28), folder / resume.MODEL_FILE)  # the whole module
    with pytest.raises(ConfigError) as error:
        resume.check_resumable(run_with(5), folder)
    assert "pickled" in str(error.value) and "weights_only" not in str(error.value)
