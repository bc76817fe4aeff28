"""The FCA benchmark compares like with like: the issue's six methods, one network, one BSM prior floor, and a
FedRS that is not BSM-FL again."""

from types import ModuleType

import pytest

from medflare.config import from_dict
from medflare.plan import validated
from medflare.registry import get_method

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("fca_vs_baselines")


def test_the_issues_six_methods_are_compared(bench: ModuleType) -> None:
    # FedAvg-BSM is bsm-fl
    assert set(bench.METHODS) == {"fca", "bsm-fl", "fedrep", "fedbabu", "fedrs", "local-only"}


def test_every_method_trains_the_same_network_data_and_schedule(bench: ModuleType) -> None:
    runs = {m: bench.setting_config("synthetic", 1, 8, m, max_steps=3) for m in bench.METHODS}
    assert {run.model for run in runs.values()} == {"cnn"}  # not FCA's own default, EfficientNet-Lite0
    assert len({repr((run.data, run.train, run.clients, run.rounds, run.seed)) for run in runs.values()}) == 1
    assert runs["fca"].train["milestones"] == [6, 7]
    lite = bench.setting_config("synthetic", 0, 8, "fedrep", 0, model="efficientnet_lite0", pretrained="imagenet")
    assert (lite.model, lite.pretrained) == ("efficientnet_lite0", "imagenet")


@pytest.mark.parametrize("rounds, milestones", [(80, [60, 70]), (20, [15, 17]), (2, [1]), (1, [])])
def test_lr_milestones_scale_with_the_rounds_and_stay_valid(bench: ModuleType, rounds: int, milestones) -> None:
    run = bench.setting_config("synthetic", 0, rounds, "fca", 0)
    assert run.train["milestones"] == milestones
    run = validated(run)  # a short smoke run is a valid job too


def test_every_method_trains_with_balanced_softmax_at_fcas_prior_floor(bench: ModuleType) -> None:
    for method in bench.METHODS:
        spec = get_method(method)
        cfg = from_dict(spec.config_cls, bench.setting_config("synthetic", 0, 4, method, 0).method_args, method)
        assert getattr(cfg, "eps", None) == 1e-9, method
        assert getattr(cfg, "loss", "bsm") == "bsm", method


def test_fedrs_runs_the_restriction_that_differs_from_bsm_fl(bench: ModuleType) -> None:
    # hard restriction + BSM trains as BSM-FL (tests/methods/test_fedrs.py); the soft one does not
    args = bench.setting_config("synthetic", 0, 4, "fedrs", 0).method_args
    assert from_dict(get_method("fedrs").config_cls, args, "fedrs").restriction == "soft"
