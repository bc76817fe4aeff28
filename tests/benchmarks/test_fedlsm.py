"""The FedLSM benchmark compares what issue 11 asks for, on equal terms, and reports mean ± std over seeds."""

import argparse
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from medflare.registry import get_method

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fedlsm.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("fedlsm_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_cells_are_fedlsm_its_three_ablations_and_every_baseline(bench: ModuleType) -> None:
    cells = {c.name: c for c in bench.CELLS}
    ablations = {c.method_args.get(k) for c in cells.values() if c.method == "fedlsm" for k in c.method_args}
    assert {c.method for c in cells.values()} == {"fedlsm", "fedavg", "fedavg-masked", "fedrs"}
    assert ablations == {"masked", False} and sum(c.method == "fedlsm" for c in cells.values()) == 4
    assert {"aggregation", "ude", "ue"} == {k for c in cells.values() if c.method == "fedlsm" for k in c.method_args}
    assert [c.full_labels for c in cells.values() if c.method == "fedavg"] == [False, True]  # lower, upper bound
    for cell in cells.values():
        get_method(cell.method).config_cls(**cell.method_args)  # registered, and its options exist


def test_every_cell_takes_the_same_steps_and_only_the_upper_bound_sees_every_label(bench: ModuleType) -> None:
    for cell in bench.CELLS:
        run = bench.setting_config("synthetic-ml", seed=1, rounds=2, steps=3, cell=cell)
        assert run.train["max_steps"] == 3 and run.rounds == 2 and run.seed == 1 and run.model == bench.MODEL
        assert run.data["partition"] == ("iid" if cell.full_labels else "labelset:2")
        if cell.method == "fedlsm":
            assert run.method_args["local_iterations"] == 3
            assert run.method_args["strong_augment"] == "strong"  # the view the published tables were measured with


def test_retina_sites_annotate_the_listed_grades_except_in_the_upper_bound(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "verify_medmnist_file", lambda path: None)  # the file itself is not needed here
    lower, upper = (bench.setting_config("retina", 0, 2, 3, c) for c in bench.CELLS if c.method == "fedavg")
    assert lower.data["identified"] == bench.IDENTIFIED_RETINA and lower.clients == 5
    assert "identified" not in upper.data and upper.data["partition"] == "iid"
    assert sorted({k for site in bench.IDENTIFIED_RETINA for k in site}) == list(range(5))  # every grade somewhere


def test_only_softmax_methods_are_left_out_of_the_multi_label_setting(bench: ModuleType) -> None:
    assert bench.skipped_cells("synthetic-ml", bench.CELLS) == ["fedrs"]
    assert bench.skipped_cells("retina", bench.CELLS) == []


def test_report_gives_mean_and_std_over_seeds(bench: ModuleType, tmp_path: Path) -> None:
    args = argparse.Namespace(setting="synthetic-ml", seeds=[0, 1], rounds=2, steps=3)
    rows = {"fedlsm": [{"seed": s, "auc_macro_ovr": auc, "macro_f1": 0.5, "accuracy": 0.4}
                       for s, auc in ((0, 0.7), (1, 0.8))]}
    bench.write_report(args, rows, ["fedrs"], tmp_path, seconds=120.0)
    report = (tmp_path / "results.md").read_text()
    assert "| fedlsm | 0.7500 ± 0.0707 | 0.5000 ± 0.0000 | 0.4000 ± 0.0000 |" in report
    assert "Not run here (single-label methods on a multi-label task): fedrs." in report
