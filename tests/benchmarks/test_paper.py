"""make bench-paper: every seed method is planned against its main baseline with its paper preset, every arm is a
valid run, and without CUDA it refuses with an estimate computed from measured step times."""

from __future__ import annotations

from types import ModuleType

import pytest

from medflare.methods.presets import PAPER
from medflare.registry import get_method, list_methods

from .conftest import load_benchmark

BASELINES = {"fedmas": "bsm-fl", "mdhfl": "fedmd", "fed-mae": "scratch", "fed-beit": "scratch",
             "fedlsm": "fedavg, fedrs", "fca": "bsm-fl, fedrep"}


@pytest.fixture(scope="module")
def paper() -> ModuleType:
    module = load_benchmark("paper")
    if not (module.MEDMNIST / "retinamnist.npz").is_file():
        pytest.skip(f"bench-paper needs ../shared/data ({module.MEDMNIST} is absent)")
    return module


@pytest.fixture(scope="module")
def runs(paper: ModuleType) -> dict:
    return paper.build_runs(list(paper.PLANS), [0])  # validates every arm of every plan


def fixed_times(key, device: str) -> float:
    """A stand-in for the measured time: depends on the step's model and batch, so the sum is checkable."""
    return 0.001 * key.batch * (2 if key.model.startswith("vit") else 1)


def test_every_seed_method_has_a_plan_and_its_arms_validate(paper: ModuleType, runs: dict) -> None:
    assert set(paper.PLANS) == {m for m in list_methods() if PAPER in get_method(m).presets}
    for method, method_runs in runs.items():
        plan = paper.PLANS[method]
        assert method_runs[0].method == method and len(method_runs) == len(plan.arms)
        lead = get_method(method).presets[PAPER].overrides
        for run in method_runs:  # a baseline trains the same network at the same resolution as the method
            assert run.model == lead["model"] and run.data["image_size"] == lead["data"]["image_size"]


def test_the_dry_run_lists_every_method_with_its_baseline(paper: ModuleType, monkeypatch, capsys) -> None:
    monkeypatch.setattr(paper, "measure_step_seconds", fixed_times)
    assert paper.main(["--dry-run", "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    for method, baseline in BASELINES.items():
        assert f"  {method} vs {baseline}: retinamnist" in out
    assert "optimizer steps, estimated" in out


def test_the_cpu_refusal_multiplies_measured_step_times_by_planned_steps(paper: ModuleType, runs: dict,
                                                                        monkeypatch, capsys) -> None:
    picked = {m: runs[m] for m in ("fca", "fedlsm")}
    est = paper.estimate(picked, "cpu", measure=fixed_times)
    expected = sum(n * fixed_times(key, "cpu") for method_runs in picked.values() for run in method_runs
                   for key, n in paper.planned_steps(run).items())
    assert est.total_seconds == pytest.approx(expected)
    # FCA: 1 epoch of full batches of 64 per site and round
    from medflare.plan import describe_sites, resolve

    fca = runs["fca"][0]
    sites, _ = describe_sites(resolve(fca, "byoc"))
    per_round = sum(max(f["n_train"] // 64, 1) for f in sites.values())
    assert sum(paper.planned_steps(fca).values()) == per_round * fca.rounds
    # FedLSM: T iterations per site and round; its baselines take as many optimizer steps
    for run in runs["fedlsm"]:
        assert sum(paper.planned_steps(run).values()) == paper.FEDLSM_ITERATIONS * run.clients * run.rounds

    monkeypatch.setattr(paper, "measure_step_seconds", fixed_times)
    monkeypatch.setattr(paper, "device_name", lambda: ("cpu", "CPU (no CUDA)"))
    assert paper.main(["--methods", "fca", "fedlsm", "--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench-paper needs a GPU: estimated ")
    assert f"estimated {expected / 3600:.1f} CPU-hours here (measured " in err
    assert "0.064 s/step for efficientnet_b0 at 224 px, batch 64" in err and "--allow-cpu" in err


def test_a_step_is_measured_for_real(paper: ModuleType) -> None:
    key = paper.StepKey("cnn", batch=8, channels=1, image_size=28, num_classes=2)
    seconds = paper.measure_step_seconds(key, "cpu", steps=1)
    assert 0 < seconds < 30
