"""Half-precision transfer (both ways), updates as differences, and FLARE's DP filter, through FLARE's simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medflare.console.simulate import run_simulation
from medflare.plan import build_global_model, resolve
from medflare.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

GAMMA = 1e-4  # PercentilePrivacy clips every shared difference to ±gamma
# fp16 against fp32 weights, same job and seed: what `benchmarks/scaling.py --part parity` reads as no difference
# (within one standard deviation over seeds, 0.020-0.031 balanced accuracy there; docs/benchmarks.md)
PARITY_TOLERANCE = 0.03


def run(tmp_path: Path, name: str, **options) -> tuple[dict, dict, Path]:
    quick = {"rounds": 1, "data": {"source": "synthetic:n=240,classes=3", "partition": "iid"},
             "train": {"max_steps": 3, "batch_size": 16}}
    config = RunConfig(method="fedavg", clients=2, audit=True, **{**quick, **options})
    summary = run_simulation(resolve(config, "byoc"), tmp_path / name, echo=lambda line: None)
    final = torch.load(tmp_path / name / "FL_global_model.pt", weights_only=False)["model"]
    return summary, final, tmp_path / name


def initial_model(summary: dict) -> dict[str, torch.Tensor]:
    """The job's initial global model, rebuilt from its configuration (same builder, same seed)."""
    task = summary["config"]["task"]
    shape = {key: task[key] for key in ("num_classes", "in_channels", "image_size")}
    return build_global_model("fedavg", "cnn", **shape, seed=0).state_dict()


def largest_change(final: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    return max(float((final[k].double() - initial[k].double()).abs().max()) for k in initial if initial[k].is_floating_point())


def train_results(out: Path, site: str, direction: str = "result") -> list[dict]:
    lines = (out / "sites" / site / "medflare_payload_audit.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["direction"] == direction and r["task"] == "train"]


def test_half_precision_differences_halve_the_bytes_and_the_model_stays_fp32(tmp_path: Path) -> None:
    summary, final, out = run(tmp_path, "fp16-diff", transfer_dtype="float16", transfer_kind="diff")
    initial = initial_model(summary)
    float_bytes_fp32 = sum(v.numel() * 4 for v in initial.values() if v.is_floating_point())
    for site in ("site-1", "site-2"):
        (result,) = train_results(out, site)
        assert all(dtype == "float16" for dtype, _ in result["arrays"].values())
        assert not any(k.endswith("num_batches_tracked") for k in result["arrays"])  # integer buffers stay home
        assert result["bytes"] == float_bytes_fp32 // 2
    assert all(v.dtype in (torch.float32, torch.int64) for v in final.values())
    assert largest_change(final, initial) > 10 * GAMMA  # the control for the DP test below
    assert 0.0 <= summary["final"]["accuracy"] <= 1.0  # the final evaluation ran and scored the model


def test_half_precision_both_ways_halves_the_bytes_and_keeps_the_metrics(tmp_path: Path) -> None:
    learning = {"rounds": 2, "data": {"source": "synthetic:n=1200", "partition": "iid"},  # 5 classes
                "train": {"max_steps": 40, "batch_size": 64, "lr": 0.003}}
    full, _, _ = run(tmp_path, "fp32", **learning)
    half, final, out = run(tmp_path, "fp16-both-ways", **learning, transfer_dtype="float16", download_dtype="float16")
    assert full["final"]["balanced_accuracy"] >= 0.25  # above chance (0.2): parity of an untrained model means nothing
    initial = initial_model(half)
    float_bytes_fp32 = sum(v.numel() * 4 for v in initial.values() if v.is_floating_point())
    int_bytes = sum(v.numel() * v.element_size() for v in initial.values() if not v.is_floating_point())
    for site in ("site-1", "site-2"):
        for task in train_results(out, site, direction="task"):  # what the site received, as it received it
            dtypes = {key: dtype for key, (dtype, _) in task["arrays"].items()}
            assert all(dtype == ("float16" if initial[key].is_floating_point() else "int64")
                       for key, dtype in dtypes.items())
            assert task["bytes"] == float_bytes_fp32 // 2 + int_bytes
    rounds = json.loads((out / "medflare_results.json").read_text())["rounds"]
    assert all(r["task_bytes"]["train"] > float_bytes_fp32 // 2 + int_bytes for r in rounds)  # + its meta
    assert all(v.dtype in (torch.float32, torch.int64) for v in final.values())  # persisted in the model's own dtype
    for metric in ("accuracy", "balanced_accuracy"):
        assert abs(half["final"][metric] - full["final"][metric]) <= PARITY_TOLERANCE, (metric, half, full)


def test_the_dp_filter_is_applied_to_every_update(tmp_path: Path) -> None:
    dp = {"filter": "percentile", "args": {"percentile": 50, "gamma": GAMMA}}
    summary, final, _ = run(tmp_path, "dp", transfer_kind="diff", dp=dp)
    assert largest_change(final, initial_model(summary)) <= GAMMA * (1 + 1e-3)
    for site in ("site-1", "site-2"):  # the server can see which filters each update went through
        assert any("PercentilePrivacy" in name for name in summary["clients"][site]["filter_history"])
