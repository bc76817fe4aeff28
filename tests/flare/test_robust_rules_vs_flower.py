"""medflare's robust rules against Flower 1.42's on the same inputs (issue 49, item 3).

``benchmarks/robust_rules_flower.py`` ran Flower's FedMedian, FedTrimmedAvg, Krum, MultiKrum and Bulyan functions in
Flower's own environment and recorded inputs and outputs (``benchmarks/results/robust_rules_flower.json``); here the
same site updates and example counts go through medflare's server aggregation core with FedAvg's weighting and the
matching ``robust`` settings. Where Flower's environment exists (``make flower-robust-reference``), Flower is also
run again now, so the recorded outputs are Flower's and not a copy that drifted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from medflare.methods.base import RoundContext
from medflare.registry import get_method
from medflare.server_round import RoundAggregation

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "benchmarks" / "results" / "robust_rules_flower.json"
SCRIPT = ROOT / "benchmarks" / "robust_rules_flower.py"
FLOWER_PYTHON = ROOT / ".venv-flower-rules" / "bin" / "python"
KEYS = ("layer.weight", "layer.bias")


def medflare_aggregate(case: dict) -> list[np.ndarray]:
    """The case's updates through RoundAggregation: FedAvg weighting, the case's robust rule."""
    updates = [[np.asarray(layer, dtype=np.float32) for layer in update] for update in case["updates"]]
    core = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=1, robust=case["robust"])
    core.start_round({key: np.zeros_like(layer) for key, layer in zip(KEYS, updates[0])}, RoundContext(0, 1))
    core.start_phase("train")
    for index, (update, count) in enumerate(zip(updates, case["counts"])):
        assert core.accept(f"site-{index:02d}", dict(zip(KEYS, update)), {"n_samples": count}) is None
    params = core.aggregate().params
    return [params[key] for key in KEYS]


def compare(recorded: dict) -> list[str]:
    assert {case["name"] for case in recorded["cases"]} >= {"median", "trimmed_mean", "krum", "multi_krum", "bulyan"}
    for case in recorded["cases"]:
        ours, flowers = medflare_aggregate(case), [np.asarray(layer) for layer in case["flower"]]
        for key, mine, theirs in zip(KEYS, ours, flowers):
            np.testing.assert_allclose(mine, theirs, rtol=2e-6, atol=1e-6, err_msg=f"{case['name']}: {key}")
        honest = np.asarray([update[0] for update in case["updates"][:-1]], dtype=np.float32)
        inside = (ours[0] >= honest.min(axis=0) - 1e-6) & (ours[0] <= honest.max(axis=0) + 1e-6)
        assert inside.all(), f"{case['name']}: a value outside every honest site's (the far site decided it)"
    return [case["name"] for case in recorded["cases"]]


def test_every_rule_gives_flowers_result_on_the_recorded_inputs() -> None:
    recorded = json.loads(RECORDED.read_text())
    assert recorded["flwr"].startswith("1.42")
    assert len(compare(recorded)) == 7


@pytest.mark.skipif(not FLOWER_PYTHON.is_file(), reason="Flower's environment is absent (make flower-robust-reference)")
def test_flower_run_now_gives_what_was_recorded_and_medflare_agrees(tmp_path: Path) -> None:
    fresh = tmp_path / "flower.json"
    subprocess.run([str(FLOWER_PYTHON), str(SCRIPT), "--out", str(fresh)], check=True, capture_output=True,
                   timeout=120)
    now, recorded = json.loads(fresh.read_text()), json.loads(RECORDED.read_text())
    assert [c["updates"] for c in now["cases"]] == [c["updates"] for c in recorded["cases"]]
    for a, b in zip(now["cases"], recorded["cases"]):
        for x, y in zip(a["flower"], b["flower"]):
            np.testing.assert_allclose(x, y, rtol=1e-12)
    compare(now)
    assert sys.executable != str(FLOWER_PYTHON)  # medflare's side ran here, Flower's in its own environment
