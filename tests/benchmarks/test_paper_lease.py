"""make bench-paper-lease: the plan keeps or states-as-cut the papers' rounds at 28 px, its dry run prints the plan
with the H100 cost model's verdict, and a stopped job resumes from its saved round and appends one result row."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def lease() -> ModuleType:
    module = load_benchmark("paper_lease")
    paper = load_benchmark("paper")
    if not (paper.MEDMNIST / "retinamnist.npz").is_file():
        pytest.skip(f"bench-paper-lease needs ../shared/data ({paper.MEDMNIST} is absent)")
    return module


def test_every_arm_is_a_valid_28_px_run_with_the_planned_rounds(lease: ModuleType) -> None:
    for method, arm in lease.arms_of(lease.PAPER_METHODS, None):
        run = lease.lease_run(method, arm, 0)
        assert run.data["image_size"] == 28
        planned = lease.LEASE_ROUNDS[method]
        expected = arm.rounds and planned["finetune_rounds"] or sum(planned.values())
        assert run.rounds == expected, (method, arm.name)
    # a kept budget says so; a cut one says what it keeps of the paper's
    assert lease.cut_line("fca").startswith("the paper's budget, uncut: 80 of the paper's 80 rounds")
    paper_mae = lease.paper_budget("fed-mae")["pretrain_rounds"]
    assert f"of the paper's {paper_mae} pretrain rounds" in lease.cut_line("fed-mae")
    assert lease.cut_line("fed-mae").startswith("CUT to fit the lease")


def test_the_wall_estimate_adds_the_arms_gpu_work_and_waits_for_the_longest_arm(lease: ModuleType) -> None:
    model = lease.CostModel({"cnn": 1e12}, startup_s=10.0)
    costs = [lease.ArmCost("a", "x", {}, 1, gpu_s=30.0, own_s=50.0), lease.ArmCost("b", "y", {}, 1, gpu_s=40.0,
                                                                                   own_s=45.0)]
    assert lease.wall_seconds(costs, model) == (70.0, 50.0, 80.0)  # GPU-bound: 30 + 40 > the longest arm's 50
    key = load_benchmark("paper").StepKey("cnn", 8, 1, 28, 2)
    gpu, own = model.step(key, lease.StepCount(flops=2e12, ops=1000))
    assert gpu == pytest.approx(max(2e12 / 1e12, 1000 * model.kernel_s))
    assert own == pytest.approx(max(gpu, 1000 * model.launch_s))


def test_a_step_is_counted_on_the_meta_device(lease: ModuleType, tmp_path: Path) -> None:
    key = load_benchmark("paper").StepKey("cnn", 8, 1, 28, 2)
    train, forward = lease.count_step(key), lease.count_step(key, train=False)
    assert train.flops == lease.BACKWARD_FACTOR * forward.flops > 0
    assert train.ops > forward.ops > 0 and train.param_bytes == forward.param_bytes > 0
    # a timed step's rate is its counted FLOPs over its seconds, read from bench-paper's printed plan
    timed = tmp_path / "plan.txt"
    timed.write_text("  measured on NVIDIA H100: 0.002 s/step for cnn at 28 px, batch 8, 0.5 s/step for x at 9 px\n")
    big = load_benchmark("paper").StepKey("cnn", 8, 3, 28, 5)
    assert lease.calibrated_rates(timed) == {"cnn": pytest.approx(lease.count_step(big).flops / 0.002)}


def test_the_dry_run_prints_the_plan_and_the_h100_verdict(lease: ModuleType, monkeypatch, capsys) -> None:
    monkeypatch.setattr(lease, "measure_step_seconds", lambda key, device: 0.001 * key.batch)
    monkeypatch.setattr(lease, "calibrated_rates", lambda: {"efficientnet_b0": 2e12})
    assert lease.main(["--dry-run", "--methods", "fca", "--arms", "fca"]) == 0
    out = capsys.readouterr().out
    assert "bench-paper-lease plan: 1 methods at 28 px, seeds [0]" in out
    assert "  fca vs bsm-fl, fedrep: retinamnist" in out and "80 of the paper's 80 rounds" in out
    assert "    fca: 6 sites, 80 rounds, efficientnet_b0, adam lr 0.001 multistep, 1 local epochs, batch 64;" in out
    assert "64 ms/step efficientnet_b0 b64" in out  # the (stubbed) measured time per step is printed
    assert "H100 estimate: GPU-bound" in out and "<= 10 min" in out


def test_a_stopped_job_resumes_from_its_saved_round_and_appends_one_row(lease: ModuleType, tmp_path: Path) -> None:
    results = tmp_path / "paper_lease.md"
    args = ["--methods", "fca", "--arms", "fca", "--rounds", "2", "--max-steps", "1", "--sites", "2", "--parallel", "1",
            "--out", str(tmp_path / "out"), "--results", str(results)]
    folder = tmp_path / "out" / "fca" / "fca-s0"

    assert lease.main([*args, "--stop-after-rounds", "1"]) == 0
    import torch

    assert torch.load(folder / "checkpoint.pt", weights_only=False)["rounds_done"] == 1
    assert sorted(p.name for p in (folder / "sites").iterdir()) == ["site-1", "site-2"]
    assert not results.exists() and not (folder / "result.json").exists()

    assert lease.main(args) == 0
    result = json.loads((folder / "result.json").read_text())
    assert result["resumed_at"] == 1 and result["trained_rounds"] == [1]  # round 2 only: round 1 was not redone
    rows = [line for line in results.read_text().splitlines() if line.startswith("| ") and "| fca | fca |" in line]
    assert len(rows) == 1 and "| 0 | fca | fca | 2 | 1 |" in rows[0]
    assert 0.0 <= result["metrics"]["balanced_accuracy"] <= 1.0
    assert f"| {result['metrics']['balanced_accuracy']:.4f} |" in rows[0]  # the row records the arm's own score

    assert lease.main(args) == 0  # finished: skipped, no second row
    assert results.read_text().count("| fca | fca |") == 1
