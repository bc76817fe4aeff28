"""The Fed-MAS cost benchmark compares like with like: the paper's Fed-MAS, each shortcut alone and all three,
against BSM-FL on the same data; the cache only where the augmentation allows it."""

import json
from types import ModuleType

import pytest

from medflare.methods.fed_mas import FedMasConfig
from medflare.plan import validated

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("fedmas_cost")


def test_every_variant_is_a_valid_demo_job(bench: ModuleType) -> None:
    args = bench.parse_args([])
    for variant, (method, options, _data) in bench.VARIANTS.items():
        run = bench.run_config(args, variant, seed=1)
        run = validated(run)
        assert (run.method, run.clients, run.rounds, run.model, run.seed) == (method, 4, 8, "cnn", 1)
        if options.get("cache_prior_features"):  # the cache needs images with fixed views
            assert run.data["augment"] == "weak"
        FedMasConfig(**options)  # every option exists and passes the method's checks


def test_the_paper_and_its_references_run_without_shortcuts(bench: ModuleType) -> None:
    for name in ("fedmas (paper)", "fedmas-weak (paper)", "bsm-fl", "bsm-fl-weak"):
        assert bench.VARIANTS[name][1] == {}
    weak = {name for name, (_, _, data) in bench.VARIANTS.items() if data}
    assert {"bsm-fl-weak", "fedmas-weak (paper)"} <= weak  # each shortcut row has its same-data reference


def test_cost_ratios_compare_fedmas_with_bsm_fl_on_the_same_data(bench: ModuleType) -> None:
    seconds = {"fedmas (paper)": 6.0, "bsm-fl": 1.0, "fedmas-weak (paper)": 7.0, "bsm-fl-weak": 2.0,
               "fedmas-weak +all three": 3.0}
    assert bench.ratio_rows(seconds) == [
        "- fedmas (paper) / bsm-fl: **6.00x** (goal <= 2x)",
        "- fedmas-weak (paper) / bsm-fl-weak: **3.50x** (goal <= 2x)",
        "- fedmas-weak +all three / bsm-fl-weak: **1.50x** (goal <= 2x)",
    ]


def test_quick_mode_times_only(bench: ModuleType) -> None:
    args = bench.parse_args(["--quick"])
    assert (args.part, args.rounds, args.steps) == ("timing", 2, 10)


def test_each_shortcut_is_read_against_the_paper_on_its_own_augmentation(bench: ModuleType) -> None:
    assert bench.REFERENCES == {
        "fedmas +reduced precision": "fedmas (paper)", f"fedmas +w pass {bench.W_PASS_PER_CLASS}/class": "fedmas (paper)",
        "fedmas-weak +cache": "fedmas-weak (paper)", "fedmas-weak +all three": "fedmas-weak (paper)",
        "fedmas (paper)": "bsm-fl", "fedmas-weak (paper)": "bsm-fl-weak",
    }
    cells = lambda *values: [{"balanced_accuracy": v} for v in values]  # noqa: E731
    accuracy = {"fedmas (paper)": cells(0.50, 0.52, 0.54), "fedmas +reduced precision": cells(0.49, 0.52, 0.55),
                "fedmas-weak +cache": cells(0.40, 0.41, 0.42)}
    assert bench.against_reference("fedmas +reduced precision", accuracy) == "+0.000 (no difference) vs fedmas (paper)"
    assert bench.against_reference("fedmas-weak +cache", accuracy) == "-"  # its reference did not run
    assert bench.against_reference("bsm-fl", accuracy) == "-"


def test_a_part_run_alone_keeps_the_other_part_of_the_same_settings(bench: ModuleType, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "site_round_parts", lambda run, rounds: dict.fromkeys(("site_round", *bench.PARTS), 1.0))
    monkeypatch.setattr(bench, "simulated", lambda run, out: {"balanced_accuracy": 0.5, "train_seconds": 2.0})
    common = ["--out", str(tmp_path), "--variants", "bsm-fl", "--seeds", "0", "1"]
    bench.main(["--part", "accuracy", *common])
    bench.main(["--part", "timing", *common])
    kept = json.loads((tmp_path / "results.json").read_text())
    assert kept["timing"]["bsm-fl"]["site_round"] == 1.0
    assert [cell["seed"] for cell in kept["accuracy"]["bsm-fl"]] == [0, 1]
    bench.main(["--part", "timing", "--rounds", "3", *common])  # other settings: the accuracy part is not theirs
    assert json.loads((tmp_path / "results.json").read_text())["accuracy"] == {}


def test_the_timing_table_shows_prior_cache_misses_only_where_a_cache_ran(bench: ModuleType) -> None:
    parts = dict.fromkeys(("site_round", *bench.PARTS), 1.0)
    timing = {"fedmas-weak +cache": {**parts, "prior_cache_misses": 37.4},
              "fedmas-weak (paper)": {**parts, "prior_cache_misses": float("nan")},
              "bsm-fl-weak": parts}  # a run recorded before the column existed
    table = bench.markdown(bench.parse_args([]), timing, {}).splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table if line.startswith("| ") and "|---" not in line}
    assert rows["fedmas-weak +cache"].endswith("| 37 |")
    assert rows["fedmas-weak (paper)"].endswith("| - |") and rows["bsm-fl-weak"].endswith("| - |")
