"""The Fed-MAS cost benchmark compares like with like: the paper's Fed-MAS, each shortcut alone and all three,
against BSM-FL on the same data; the cache only where the augmentation allows it."""

from types import ModuleType

import pytest

from medflare.methods.fed_mas import FedMasConfig

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("fedmas_cost")


def test_every_variant_is_a_valid_demo_job(bench: ModuleType) -> None:
    args = bench.parse_args([])
    for variant, (method, options, data) in bench.VARIANTS.items():
        run = bench.run_config(args, variant, seed=1)
        run.validate()
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
