"""A simulator run streams its metrics through FLARE's analytics events: the server's TensorBoard and MLflow
records hold every round's pooled metrics (equal to summary.json's) and each site's training and validation
series, MLflow in one named run with the job's params, and the live progress lines are the ones ``medflare watch``
rebuilds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medflare.console.simulate import run_simulation
from medflare.flare import tracking
from medflare.flare.progress import entries_from_results, format_progress
from medflare.plan import resolve
from medflare.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

ROUNDS, EPOCHS = 2, 2


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> tuple[Path, dict, list[str]]:
    out = tmp_path_factory.mktemp("tracked") / "run"
    run = RunConfig(method="fedavg", rounds=ROUNDS, clients=2, tracking="both",
                    data={"source": "synthetic:n=300", "partition": "iid"},
                    train={"max_steps": 6, "batch_size": 32, "local_epochs": EPOCHS})
    lines: list[str] = []
    summary = run_simulation(resolve(run, "byoc"), out, echo=lines.append)
    return out, summary, lines


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def assert_series(recorded: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """Same steps; values equal up to TensorBoard's float32."""
    assert [step for step, _ in recorded] == [step for step, _ in expected]
    assert [value for _, value in recorded] == pytest.approx([value for _, value in expected], abs=1e-6)


def results_of(out: Path) -> dict:
    return json.loads((out / "medflare_results.json").read_text())


def round_losses(results: dict, site: str) -> list[tuple[int, float]]:
    """(round from 1, the site's mean training loss) of every round, as the server recorded them."""
    return [(r + 1, record["sites"][site]["train_loss"]) for r, record in enumerate(results["rounds"])]


def test_tensorboard_holds_every_rounds_pooled_metrics_as_in_the_results(tracked_run) -> None:
    out, summary, _ = tracked_run
    results = results_of(out)
    server = [d for d in (out / "tb_events").iterdir() if not d.name.startswith("site-")]
    assert len(server) == 1, sorted(p.name for p in (out / "tb_events").iterdir())
    recorded = scalars(server[0])
    versions = list(range(ROUNDS + 1))  # model 0 (initial) .. model ROUNDS (final)
    for split in ("val", "test"):
        expected = [results["evaluations"][str(v)][split]["balanced_accuracy"] for v in versions]
        assert_series(recorded[f"{split}/balanced_accuracy"], list(zip(versions, expected)))
    assert recorded["test/balanced_accuracy"][-1][1] == pytest.approx(summary["final"]["balanced_accuracy"], abs=1e-6)
    for site in ("site-1", "site-2"):
        assert [s for s, _ in recorded[f"{site}/test/balanced_accuracy"]] == versions
        assert_series(recorded[f"train_loss/{site}"], round_losses(results, site))
    shares = [(r + 1, record["share"]["site-1"]) for r, record in enumerate(results["rounds"])]
    assert_series(recorded["share/site-1"], shares)


def test_each_site_streams_its_training_and_validation_series_and_nothing_else(tracked_run) -> None:
    out, _, _ = tracked_run
    results = results_of(out)
    for site in ("site-1", "site-2"):
        recorded = scalars(out / "tb_events" / site)
        assert set(recorded) <= tracking.SITE_STREAMED_TAGS
        assert {"train/loss", "train/seconds", "train/lr", "val/balanced_accuracy", "val/loss"} <= set(recorded)
        assert_series(recorded["train/loss"], round_losses(results, site))  # the loss its results carried
        assert [s for s, _ in recorded["train/lr"]] == list(range(1, ROUNDS + 1))
        # every model it received, the initial one to the final one (the last validation)
        assert [s for s, _ in recorded["val/balanced_accuracy"]] == list(range(ROUNDS + 1))
        assert [s for s, _ in recorded["train/epoch_loss"]] == list(range(ROUNDS * EPOCHS))
        epoch_losses = [v for _, v in recorded["train/epoch_loss"]]
        for r, record in enumerate(results["rounds"]):  # a round's loss is the step-weighted mean of its epochs
            pair = epoch_losses[r * EPOCHS:(r + 1) * EPOCHS]
            assert min(pair) - 1e-6 <= record["sites"][site]["train_loss"] <= max(pair) + 1e-6


def test_mlflow_records_the_job_as_one_named_run_with_its_params(tracked_run) -> None:
    from mlflow.tracking import MlflowClient

    out, summary, _ = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    assert client.get_experiment(run.info.experiment_id).name == "medflare"
    assert run.info.run_name.startswith("fedavg-cnn-s0-")
    assert run.data.tags["env"] == "simulator" and run.data.params["train.max_steps"] == "6"
    history = client.get_metric_history(run.info.run_id, "test/balanced_accuracy")
    assert sorted(m.step for m in history) == list(range(ROUNDS + 1))
    final = next(m.value for m in history if m.step == ROUNDS)
    assert final == pytest.approx(summary["final"]["balanced_accuracy"], abs=1e-9)
    for site in ("site-1", "site-2"):  # the sites' own series, under their names
        assert [m.step for m in client.get_metric_history(run.info.run_id, f"{site}/train/loss")] == [1, 2]


def test_live_progress_lines_are_the_ones_watch_rebuilds(tracked_run) -> None:
    out, _, lines = tracked_run
    results = json.loads((out / "medflare_results.json").read_text())
    live = [line.strip()[len("medflare: "):] for line in lines
            if line.strip().startswith(("medflare: round", "medflare: model")) and "started" not in line]
    assert live == [format_progress(e) for e in entries_from_results(results)]
