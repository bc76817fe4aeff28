"""The accuracy-against-ε benchmark: every cell is the same FedAvg job, its σ spends exactly the target ε, and the
table reports mean ± std over seeds."""

import math

import pytest

from medflare.dp_sgd import epsilon_of

from .conftest import load_benchmark

bench = load_benchmark("dp_epsilon")
pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # the σ search's early tries


def test_each_cell_calibrates_sigma_to_its_target_epsilon_and_every_arm_shares_one_recipe() -> None:
    rounds, steps = 5, 15
    site_images = bench.TRAIN_IMAGES // bench.CLIENTS
    sample_rate = bench.BATCH / site_images
    for target in (8.0, 1.0):
        config = bench.run_config(target, 1, rounds, steps)
        spent = epsilon_of([(config.dp_sgd["noise_multiplier"], sample_rate, rounds * steps)], bench.DELTA)
        assert target * 0.98 <= spent <= target  # Opacus's search stops within 1 % below the target
        assert config.dp_sgd["max_grad_norm"] == bench.MAX_GRAD_NORM
        assert (config.method, config.model, config.clients, config.seed) == ("fedavg", "cnn", 2, 1)
    unclipped = bench.run_config(math.inf, 0, rounds, steps)
    assert unclipped.dp_sgd["max_grad_norm"] == 100.0 and unclipped.dp_sgd["noise_multiplier"] <= 1e-3
    assert bench.run_config(bench.BATCHNORM, 0, rounds, steps).dp_sgd == {}  # the plain cnn: no DP-SGD at all
    arms = [bench.run_config(arm, 0, rounds, steps) for arm in (bench.BATCHNORM, math.inf, 3.0)]
    assert all(config.train == arms[0].train for config in arms)  # only DP-SGD differs between the arms
    train = arms[0].train
    assert (train["optimizer"], train["batch_size"], train["max_steps"]) == ("sgd", bench.BATCH, steps)
    assert train["local_epochs"] * site_images / bench.BATCH >= steps  # Poisson epochs: every round takes its steps


def test_the_table_gives_mean_and_std_over_seeds_per_arm() -> None:
    cells = [{"arm": bench.BATCHNORM, "noise_multiplier": None, "max_grad_norm": None, "epsilon": None,
              "accuracy": a, "balanced_accuracy": a} for a in (0.7, 0.8)]
    cells += [{"arm": math.inf, "noise_multiplier": 0.001, "max_grad_norm": 100.0, "epsilon": 9e7, "accuracy": 0.8,
               "balanced_accuracy": 0.75}]
    cells += [{"arm": 3.0, "noise_multiplier": 1.738, "max_grad_norm": 8.0, "epsilon": e, "accuracy": 0.6,
               "balanced_accuracy": 0.5} for e in (2.99, 3.0)]
    lines = bench.table(cells).splitlines()
    assert lines[2] == "| ∞, plain cnn (BatchNorm), no DP-SGD | - | - | - | 2 | 0.7500 ± 0.0707 | 0.7500 ± 0.0707 |"
    assert lines[3] == ("| ∞, DP-compatible cnn, C = 100, σ = 0.001 | 0.001 | 100 | - | 1 | 0.8000 ± 0.0000 | "
                        "0.7500 ± 0.0000 |")
    assert lines[4] == "| 3 | 1.74 | 8 | 3.00 | 2 | 0.6000 ± 0.0000 | 0.5000 ± 0.0000 |"
