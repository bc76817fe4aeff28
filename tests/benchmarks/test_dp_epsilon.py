"""The accuracy-against-ε benchmark: every cell is the same FedAvg job, its σ spends exactly the target ε, and the
table reports mean ± std over seeds."""

import math

import pytest

from medflare.dp_sgd import epsilon_of

from .conftest import load_benchmark

bench = load_benchmark("dp_epsilon")
pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # the σ search's early tries


def test_each_cell_calibrates_sigma_to_its_target_epsilon_and_infinity_has_no_dp() -> None:
    rounds, steps = 5, 30
    assert bench.run_config(math.inf, 0, rounds, steps).dp_sgd == {}
    sample_rate = bench.BATCH / (bench.TRAIN_IMAGES // bench.CLIENTS)
    for target in (8.0, 1.0):
        config = bench.run_config(target, 1, rounds, steps)
        spent = epsilon_of([(config.dp_sgd["noise_multiplier"], sample_rate, rounds * steps)], bench.DELTA)
        assert target * 0.98 <= spent <= target  # Opacus's search stops within 1 % below the target
        assert (config.method, config.model, config.clients, config.seed) == ("fedavg", "cnn", 2, 1)


def test_the_table_gives_mean_and_std_over_seeds_per_target() -> None:
    cells = [{"target_epsilon": math.inf, "noise_multiplier": None, "epsilon": None, "accuracy": a,
              "balanced_accuracy": a} for a in (0.7, 0.8)]
    cells += [{"target_epsilon": 3.0, "noise_multiplier": 0.95, "epsilon": e, "accuracy": 0.6,
               "balanced_accuracy": 0.5} for e in (2.99, 3.0)]
    lines = bench.table(cells).splitlines()
    assert lines[2] == "| ∞ | - | - | 2 | 0.7500 ± 0.0707 | 0.7500 ± 0.0707 |"
    assert lines[3] == "| 3 | 0.950 | 3.00 | 2 | 0.6000 ± 0.0000 | 0.5000 ± 0.0000 |"
