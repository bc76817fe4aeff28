"""End to end in FLARE's simulator: 2 sites x 2 rounds, then the outputs a user reads."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from medflare.console.simulate import nvflare_command, run_simulation
from medflare.plan import resolve, validated
from medflare.run_config import RunConfig

from ._rescoring import rescore_global_model

pytestmark = pytest.mark.slow

QUICK = {"max_steps": 3, "batch_size": 32}
DATA = {"source": "synthetic:n=400", "partition": "dirichlet:1.0"}
FEDAVG = RunConfig(method="fedavg", rounds=2, clients=2, data=DATA, train=QUICK)


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("runs") / "fedavg"
    summary = run_simulation(resolve(FEDAVG, "byoc"), out, echo=lambda line: None)
    return out, summary


@pytest.mark.smoke  # single phase
def test_summary_has_every_documented_field(fedavg_run) -> None:
    out, summary = fedavg_run
    on_disk = json.loads((out / "summary.json").read_text())
    for key in ("method", "config", "rounds_completed", "final", "per_round", "clients", "payload", "timing"):
        assert key in on_disk, key
    assert on_disk["method"] == "fedavg" and on_disk["rounds_completed"] == 2
    assert on_disk["final"] == summary["final"]
    assert [r["round"] for r in on_disk["per_round"]] == [1, 2]
    assert set(on_disk["per_round"][0]["share"]) == {"site-1", "site-2"}
    assert sum(on_disk["per_round"][0]["share"].values()) == pytest.approx(1.0)
    assert on_disk["timing"]["startup_seconds"] > 0 and len(on_disk["timing"]["per_round_seconds"]) == 2


@pytest.mark.smoke  # single phase
def test_the_server_and_both_sites_ran_the_plan_the_command_line_built(fedavg_run) -> None:
    """The fingerprint of the plan ``medflare config --plan`` prints is the one the server records and every site
    logs: each rebuilt it from the job FLARE deployed (tests/test_plan.py compares the plans field by field)."""
    out, _ = fedavg_run
    run = dataclasses.replace(FEDAVG, data=dict(DATA), train=dict(QUICK))
    run = validated(run, check_files=False)
    digest = resolve(run, "byoc").digest()
    assert json.loads((out / "medflare_results.json").read_text())["plan"] == digest
    assert json.loads((out / "summary.json").read_text())["plan_check"] == "matches"  # the run checked it too
    logged = re.findall(r"(site-\d): runs plan (\w+)", (out / "simulator.log").read_text())
    assert sorted(logged) == [("site-1", digest), ("site-2", digest)]


@pytest.mark.smoke  # single phase
def test_final_metrics_are_those_of_the_saved_global_model_on_the_pooled_test_split(fedavg_run) -> None:
    # Prepare
    out, summary = fedavg_run
    # Execute: reload FL_global_model.pt and score every site's test split in this process, with sklearn
    rescored = rescore_global_model(out, FEDAVG)
    # Assert
    assert rescored["count"] == sum(facts["n_test"] for facts in summary["clients"].values())
    assert summary["final"]["balanced_accuracy"] == pytest.approx(rescored["balanced_accuracy"], abs=1e-12)
    assert summary["final"]["accuracy"] == pytest.approx(rescored["accuracy"], abs=1e-12)
    assert summary["final"]["loss"] == pytest.approx(rescored["loss"], rel=1e-6)  # float32 sums at the sites
    assert summary["final"]["loss"] != pytest.approx(summary["initial"]["loss"], rel=1e-6)  # a trained model


@pytest.mark.smoke  # single phase
def test_payload_records_exactly_the_declared_keys(fedavg_run) -> None:
    _, summary = fedavg_run
    for sent in summary["payload"].values():
        assert sent["meta_keys"] == sorted(
            ["eval_test", "eval_test_by_attribute", "eval_val", "n_samples", "train_loss", "train_seconds"]
        )
        assert all(b > 1000 for b in sent["bytes_per_round"])


@pytest.mark.smoke  # single phase
def test_sites_report_their_partition_sizes(fedavg_run) -> None:
    _, summary = fedavg_run
    for site in ("site-1", "site-2"):
        facts = summary["clients"][site]
        assert facts["n_samples_reported"] == facts["n_train"] > 0


@pytest.mark.smoke  # single phase
def test_outputs_written_and_nothing_partial_left(fedavg_run) -> None:
    out, _ = fedavg_run
    for name in ("summary.json", "rounds.csv", "report.md", "learning_curves.png", "shares.png", "FL_global_model.pt"):
        assert (out / name).is_file(), name
    assert not out.with_name(out.name + ".partial").exists()
    assert len((out / "rounds.csv").read_text().strip().splitlines()) == 4  # header + round 0 + 2 rounds


@pytest.mark.heavy  # make test-heavy
def test_exported_byoc_job_runs_under_nvflare_simulator(tmp_path: Path) -> None:
    export = subprocess.run(
        [sys.executable, "-m", "medflare.console.cli", "export", "fedprox", "-o", str(tmp_path / "jobs"), "--mode", "byoc",
         "--data", "synthetic:n=300", "--rounds", "1", "--set", "train.max_steps=2"],
        capture_output=True, text=True, check=True,
    )
    job = tmp_path / "jobs" / "fedprox"
    assert (job / "app" / "custom" / "medflare" / "flare" / "executor.py").is_file(), export.stdout
    sim = subprocess.run(
        nvflare_command() + ["simulator", str(job), "-w", str(tmp_path / "ws"), "-n", "2", "-t", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert sim.returncode == 0, sim.stdout[-3000:] + sim.stderr[-3000:]
    results = next((tmp_path / "ws").glob("**/app_server/medflare_results.json"))
    assert len(json.loads(results.read_text())["rounds"]) == 1


DIVERGING_SITE_2 = {"site-2": {"optimizer": "sgd", "lr": 1e30}}


@pytest.mark.heavy  # make test-heavy
def test_a_failing_site_is_left_out_and_the_round_goes_on(tmp_path: Path) -> None:
    run = RunConfig(method="fedavg", rounds=2, clients=2, min_clients=1, data=DATA, train=QUICK, site_train=DIVERGING_SITE_2)
    summary = run_simulation(resolve(run, "byoc"), tmp_path / "out", echo=lambda line: None)
    for entry in summary["per_round"]:
        assert entry["share"] == {"site-1": 1.0}
        assert "site-2" in entry["failed"]
    assert summary["rounds_completed"] == 2


@pytest.mark.heavy  # make test-heavy
def test_too_few_sites_stops_the_job_with_a_clear_error_and_no_output(tmp_path: Path) -> None:
    from medflare.errors import MedflareError

    run = RunConfig(method="fedavg", rounds=2, clients=2, data=DATA, train=QUICK, site_train=DIVERGING_SITE_2)
    with pytest.raises(MedflareError, match="min_clients=2"):
        run_simulation(resolve(run, "byoc"), tmp_path / "out", echo=lambda line: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert (tmp_path / "out.failed.log").is_file()


@pytest.mark.realdata
@pytest.mark.parametrize("method", ["fedavg", "bsm-fl"])  # every method runs on synthetic data elsewhere
@pytest.mark.heavy  # make test-heavy
def test_baselines_complete_on_pneumoniamnist(method: str, medmnist_file, tmp_path: Path) -> None:
    path = medmnist_file("pneumoniamnist.npz")
    run = RunConfig(method=method, rounds=2, clients=3, data={"source": f"medmnist:{path}", "partition": "dirichlet:0.5"},
                    train=QUICK)
    summary = run_simulation(resolve(run, "byoc"), tmp_path / method, echo=lambda line: None)
    assert summary["rounds_completed"] == 2
    assert summary["config"]["task"] == {"num_classes": 2, "in_channels": 1, "image_size": 28,
                                         "class_names": ["class_0", "class_1"], "multi_label": False}
    assert set(summary["per_round"][-1]["share"]) == {"site-1", "site-2", "site-3"}
    assert sum(f["n_val"] for f in summary["clients"].values()) == 524  # the official val split, spread over sites
    rescored = rescore_global_model(tmp_path / method, run)
    assert summary["final"]["balanced_accuracy"] == pytest.approx(rescored["balanced_accuracy"], abs=1e-12)
    assert summary["final"]["loss"] == pytest.approx(rescored["loss"], rel=1e-6)
