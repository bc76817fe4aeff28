"""The Fed-MAS benchmark's report: the cost-ratio line survives ``--set`` labels."""

import argparse
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("fedmas_vs_baselines")


def cell(seed: int, train_seconds: float) -> dict:
    return {"seed": seed, "balanced_accuracy": 0.3, "tail_accuracy": 0.0, "head_accuracy": 0.7,
            "medium_accuracy": 0.2, "train_seconds": train_seconds, "round_seconds": 10.0}


def test_cost_ratio_looks_methods_up_by_name(bench: ModuleType) -> None:
    assert bench.cost_ratio({"fedmas": 6.0, "bsm-fl": 1.5, "fedavg": 1.0}) == pytest.approx(4.0)
    assert bench.cost_ratio({"fedmas": 6.0, "fedavg": 1.0}) is None


@pytest.mark.parametrize("overrides", [[], ["eps=1e-09"]])
def test_report_keeps_the_cost_ratio_when_set_labels_the_rows(bench: ModuleType, tmp_path: Path, overrides) -> None:
    # Prepare: Fed-MAS 6 and 4 s (mean 5), BSM-FL 1 and 1.5 s (mean 1.25) -> ratio 4.00
    args = argparse.Namespace(setting="synthetic", seeds=[0, 1], rounds=2, set=overrides)
    rows = {"fedmas": [cell(0, 6.0), cell(1, 4.0)], "bsm-fl": [cell(0, 1.0), cell(1, 1.5)]}
    # Execute
    bench.write_report(args, rows, tmp_path, seconds=60.0)
    # Assert
    report = (tmp_path / "results.md").read_text()
    assert "BSM-FL local work per round: **4.00x**" in report
    label = "".join(f"[{item}]" for item in overrides)
    assert f"| fedmas{label} | 0.3000 ± 0.0000" in report and f"| bsm-fl{label} |" in report
