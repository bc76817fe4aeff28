"""``make bench-converged`` (issue 63): the plan and its estimate, the learning rate chosen on the tuning seed
only, the paired reading against a hand-computed case, resuming from the stored rows, and (heavy) one arm's run
through the in-process engine with the controller's early stopping and selection."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.conftest import load_benchmark

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "medmnist" / "retinamnist.npz"


@pytest.fixture(scope="module")
def converged() -> ModuleType:
    return load_benchmark("converged")


@pytest.fixture(scope="module")
def report() -> ModuleType:
    load_benchmark("converged")
    return load_benchmark("converged_report")


def test_the_dry_run_prints_every_claim_and_an_estimate_within_the_budget(converged, capsys, tmp_path) -> None:
    # the plan alone, no run finished (exit 1 when the estimate is over the 5 CPU-hour budget)
    assert converged.main(["--dry-run", "--results", str(tmp_path / "none.json")]) == 0
    text = capsys.readouterr().out
    for claim in converged.CLAIMS:
        assert claim.name in text
    runs = len(converged.planned_runs(list(converged.CLAIMS)))
    assert f"converged: {runs} runs" in text
    per_arm = len(converged.LR_GRID) + len(converged.SEEDS)
    assert runs == per_arm * sum(len(c.arms) for c in converged.CLAIMS)
    assert "CPU-hours" in text and "SSL-FL pre-training: 12 jobs" in text  # 2 methods x (5 seeds + tuning seed)


def test_every_claim_compares_its_method_with_fedavg_and_fedadam_arms(converged) -> None:
    for claim in converged.CLAIMS:
        names = {arm.name for arm in claim.arms}
        assert any(a.method == "fedavg" or "FedAvg" in a.name for a in claim.arms), claim.name
        assert any(a.sections.get("server_optimizer", {}).get("name") == "fedadam" for a in claim.arms), claim.name
        assert all(m in names and b in names for m, b in claim.comparisons), claim.name
        assert set(claim.round_seconds) == names, claim.name  # every arm is in the estimate


def test_no_scored_seed_is_the_tuning_seed(converged) -> None:
    assert converged.TUNING_SEED not in converged.SEEDS and len(converged.SEEDS) == 5


@pytest.mark.skipif(not SHARED.is_file(), reason="needs ../shared/data (RetinaMNIST)")
def test_a_run_config_carries_the_arm_the_seed_the_lr_and_the_budget(converged) -> None:
    key = converged.RunKey("mdhfl-retina-pairflip", "fedadam (cnn at every site)", 3, 3e-3)
    run = converged.run_config(key)
    assert (run.method, run.seed, run.train["lr"], run.rounds, run.patience) == \
        ("fedavg", 3, 3e-3, converged.ROUNDS_CAP, converged.PATIENCE)
    assert run.site_evaluation == "every_round" and run.server_optimizer["name"] == "fedadam"
    assert not run.site_model  # the homogeneous arm drops the per-site architectures
    assert run.data["noise_kind"] == "pairflip" and run.data["label_noise"] == 0.2
    mdhfl = converged.run_config(converged.RunKey("mdhfl-retina-pairflip", "mdhfl", 3, 3e-3))
    assert mdhfl.site_model == converged.MDHFL_MODELS
    upper = converged.run_config(converged.RunKey("fedlsm-retina", "fedavg, every label (upper bound)", 0, 1e-3))
    lower = converged.run_config(converged.RunKey("fedlsm-retina", "fedavg, labelled only (lower bound)", 0, 1e-3))
    assert upper.data.get("identified") is None and lower.data["identified"] == converged.IDENTIFIED_RETINA
    assert converged.config_digest(upper) != converged.config_digest(lower)


@pytest.mark.skipif(not SHARED.is_file(), reason="needs ../shared/data (RetinaMNIST)")
def test_an_ssl_run_is_found_by_its_pre_training_job_not_by_the_encoders_path(converged) -> None:
    # the planner looks a run up before any encoder exists: the digest names the pre-training job, so a stored
    # fine-tuning run is found again (it was not, and ran twice) and is never mistaken for its scratch arm
    pretrained = converged.RunKey("ssl-fl-retina-f0.1", "fed-mae", 100, 1e-3)
    scratch = converged.RunKey("ssl-fl-retina-f0.1", "scratch (FedAvg, MAE recipe)", 100, 1e-3)
    assert converged.key_digest(pretrained) != converged.key_digest(scratch)
    assert converged.key_digest(pretrained) != converged.key_digest(converged.RunKey(
        "ssl-fl-retina-f0.1", "fed-mae", 0, 1e-3))  # another seed: another pre-training job
    label = converged.pretraining_label(converged.CLAIM[pretrained.claim].arm("fed-mae"), 100)
    assert label.startswith("pre-training fed-mae-pt-retina-a0.5-s100 ") and "/" not in label
    for fraction, epochs in converged.SSL_LOCAL_EPOCHS.items():
        run = converged.run_config(converged.RunKey(f"ssl-fl-retina-f{fraction:g}", "fed-beit", 0, 1e-3))
        assert run.train["local_epochs"] == epochs and run.data["label_fraction"] == fraction


@pytest.mark.skipif(not SHARED.is_file(), reason="needs ../shared/data (RetinaMNIST)")
def test_a_runs_digest_does_not_depend_on_where_the_shared_data_lies(converged) -> None:
    # a clone elsewhere (CI's) must find the rows this machine stored: the file is named, its MD5 checked
    import dataclasses

    run = converged.run_config(converged.RunKey("fca-retina", "fca", 0, 1e-3))
    moved = dataclasses.asdict(run)
    moved["data"]["source"] = "medmnist:/elsewhere/clone/../shared/data/medmnist/retinamnist.npz"
    assert converged._digest(moved) == converged.config_digest(run)
    moved["data"]["source"] = "medmnist:/elsewhere/pneumoniamnist.npz"
    assert converged._digest(moved) != converged.config_digest(run)  # another file is another job


def test_the_estimate_counts_a_finished_run_at_what_it_took(converged, tmp_path) -> None:
    claims = [converged.CLAIM["fca-retina"]]
    _, planned, _ = converged.estimate(claims)
    store = converged.Store(tmp_path / "converged.json")
    key = converged.RunKey("fca-retina", "fca", converged.TUNING_SEED, converged.LR_GRID[0])
    store.add({**row(key.claim, key.arm, key.seed, key.lr, 0.4, {}), "seconds": 1.0,
               "config": converged.key_digest(key)})
    text, measured, _ = converged.estimate(claims, store)
    model = claims[0].round_seconds["fca"] * claims[0].typical_rounds + converged.RUN_SECONDS
    assert measured == pytest.approx(planned - model + 1.0) and "1 done in 0 CPU-min" in text


def row(claim: str, arm: str, seed: int, lr: float, val: float, figure: dict, tuning: bool = False) -> dict:
    return {"claim": claim, "arm": arm, "seed": seed, "lr": lr, "tuning": tuning, "val_best": val,
            "figures": figure, "rounds_run": 10, "stopped_early": seed != 4, "curve": [[0, 0.2], [1, val]], "metric": "balanced_accuracy",
            "commit": "abc", "cpu": "cpu", "config": "x", "seconds": 7.2}


def test_the_paired_reading_against_a_hand_computed_case(report) -> None:
    # differences 0.10, 0.20, 0.00, 0.10, 0.10: mean 0.10, sample std sqrt(0.02 / 4) = 0.0707 -> above, 4 of 5
    reading = report.paired([0.6, 0.7, 0.5, 0.6, 0.6], [0.5, 0.5, 0.5, 0.5, 0.5])
    assert reading["mean"] == pytest.approx(0.10) and reading["std"] == pytest.approx(math.sqrt(0.005))
    assert (reading["reading"], reading["above"], reading["seeds"]) == ("above", 4, 5)
    # differences +0.1, -0.1, +0.1, -0.1, +0.05: mean 0.01, std 0.096 -> no difference
    assert report.paired([0.6, 0.4, 0.6, 0.4, 0.55], [0.5] * 5)["reading"] == "no difference"
    assert report.paired([0.4, 0.41, 0.39, 0.4, 0.4], [0.5] * 5)["reading"] == "below"
    assert report.claim_reading(["above", "above"]) == "reproduced"
    assert report.claim_reading(["above", "below"]) == "not reproduced"
    assert report.claim_reading(["above", "no difference"]) == "no difference"


def test_each_arms_lr_is_chosen_on_the_tuning_seeds_validation_and_its_seeds_are_read_paired(converged, report,
                                                                                             tmp_path) -> None:
    claim = converged.CLAIM["fedmas-retina-lt"]
    tuning = converged.TUNING_SEED
    rows = [row(claim.name, arm.name, tuning, lr, val, {}, tuning=True)
            for arm in claim.arms for lr, val in zip(converged.LR_GRID, (0.3, 0.5, 0.4))]
    rows[0]["val_best"] = 0.9  # fedmas: the smallest lr wins on validation
    for seed in converged.SEEDS:
        for arm in claim.arms:
            lr = converged.LR_GRID[0] if arm.name == "fedmas" else converged.LR_GRID[1]
            value = 0.5 + 0.1 * (arm.name == "fedmas") + 0.01 * seed
            rows.append(row(claim.name, arm.name, seed, lr, 0.0, {"balanced_accuracy": value}))
        # a row at a learning rate the tuning did not choose is not read
        rows.append(row(claim.name, "bsm-fl", seed, converged.LR_GRID[2], 0.0, {"balanced_accuracy": 0.99}))
    result = report.claim_result(rows, claim)
    assert result["lrs"]["fedmas"] == converged.LR_GRID[0] and result["lrs"]["bsm-fl"] == converged.LR_GRID[1]
    assert result["figures"]["bsm-fl"]["balanced_accuracy"][0] == pytest.approx(0.52)
    first = result["comparisons"][("fedmas", "bsm-fl")]
    assert first["mean"] == pytest.approx(0.1) and first["above"] == 5 and first["reading"] == "above"
    assert result["reading"] == "reproduced" and result["at_cap"]["fedmas"] == 1  # seed 4 ran to the cap
    text = report.write_report(rows, [claim], tmp_path)
    assert "Reading: **reproduced**" in text and "| fedmas − bsm-fl | +0.100 | 0.000 | 5 of 5 | above |" in text
    assert f"| fedmas | {converged.LR_GRID[0]:g} (grid edge) |" in text  # the best lr may lie beyond the grid
    assert f"| bsm-fl | {converged.LR_GRID[1]:g} |" in text
    assert f"The {len(rows)} runs took {len(rows) * 7.2 / 3600:.2f} CPU-hours in all" in text  # 7.2 s each
    assert (tmp_path / "converged-fedmas-retina-lt.png").is_file() and (tmp_path / "converged.md").is_file()


def test_a_claim_with_missing_seeds_is_not_read(converged, report) -> None:
    claim = converged.CLAIM["fca-retina"]
    rows = [row(claim.name, arm.name, converged.TUNING_SEED, lr, 0.5, {}, tuning=True)
            for arm in claim.arms for lr in converged.LR_GRID]
    rows.append(row(claim.name, "fca", 0, converged.LR_GRID[0], 0.0, {"gs_mean_bacc": 0.5}))
    assert report.claim_result(rows, claim)["reading"] == "not run to the end"


def test_the_store_appends_atomically_and_finds_a_row_only_with_the_same_configuration(converged, tmp_path) -> None:
    path = tmp_path / "converged.json"
    store = converged.Store(path)
    key = converged.RunKey("fca-retina", "fca", 0, 1e-3)
    store.add({**row(key.claim, key.arm, key.seed, key.lr, 0.4, {}), "config": "digest-a"})
    again = converged.Store(path)  # a rerun reads what the first wrote
    assert again.find(key, "digest-a")["val_best"] == 0.4
    assert again.find(key, "digest-b") is None  # another configuration is run again, not reused
    assert json.loads(path.read_text())[0]["arm"] == "fca" and not path.with_suffix(".tmp").exists()
    if SHARED.is_file():  # only rows of today's configuration are read by the report
        seed_1 = converged.RunKey(key.claim, key.arm, 1, key.lr)
        store.add({**row(key.claim, key.arm, 1, key.lr, 0.5, {}), "config": converged.key_digest(seed_1)})
        assert [r["seed"] for r in converged.Store(path).current([converged.CLAIM["fca-retina"]])] == [1]


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(not SHARED.is_file(), reason="needs ../shared/data (RetinaMNIST)")
def test_one_arm_smoke_run_stores_a_row_with_its_curve_chosen_version_and_figures(converged, tmp_path, capsys) -> None:
    results = tmp_path / "converged.json"
    assert converged.main(["--smoke", "--results", str(results), "--out", str(tmp_path / "out")]) == 0
    (stored,) = json.loads(results.read_text())
    assert stored["claim"] == converged.CLAIMS[0].name and stored["rounds_run"] == len(stored["curve"])
    assert [v for v, _ in stored["curve"]] == list(range(stored["rounds_run"]))
    best = max(stored["curve"], key=lambda point: point[1])  # the first best version, as the controller keeps it
    assert stored["best_version"] == next(v for v, s in stored["curve"] if s == best[1])
    assert 0.0 <= stored["figures"]["balanced_accuracy"] <= 1.0 and stored["commit"] and stored["cpu"]
    assert "round 1/2" in capsys.readouterr().out  # a progress line per round
