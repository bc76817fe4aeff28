"""The server optimizers' rules (Reddi et al. 2021, Algorithm 2; Hsu et al. 2019, §3) as the server aggregates:
two rounds of two sites through ``RoundAggregation`` (the round core FLARE's aggregator and the in-process engine
drive), each rule's global model against the update computed by hand from the paper's equations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from medflare.errors import ConfigError
from medflare.methods.base import RoundContext
from medflare.ops.server_opt import DEFAULT_LR, ServerOptConfig, typed_server_optimizer
from medflare.registry import get_method
from medflare.server_round import SERVER_OPT_INFO, RoundAggregation

SHAPE = (2, 3)
START = {"w": np.zeros(SHAPE, np.float32), "bn.num_batches_tracked": np.array(0, np.int64)}
# round 1: both sites at 2.0 (Δ₁ = +2); round 2: both at x₁ − 1 (Δ₂ = −1, the direction turns)
DELTAS = (2.0, -1.0)
B1, B2, TAU = 0.9, 0.99, 1e-3


def two_rounds(options: dict, robust: dict | None = None, sent: tuple[float, float] | None = None,
               samples: tuple[int, int] = (10, 10)) -> list[dict[str, np.ndarray]]:
    """The global model after each of two rounds of fedavg with ``options`` as its server optimizer; ``sent``: the
    sites' values of round 1 instead of 2.0 each (round 2 is then 1.0 below the global model for both)."""
    core = RoundAggregation(get_method("fedavg"), {}, num_classes=3, num_rounds=2, robust=robust,
                            server_optimizer=options)
    params, models = dict(START), []
    for index, delta in enumerate(DELTAS):
        core.start_round(params, RoundContext(index, 2))
        core.start_phase("train")
        values = sent if sent is not None and index == 0 else (float(params["w"][0, 0]) + delta,) * 2
        for site, (value, n) in enumerate(zip(values, samples)):
            arrays = {"w": np.full(SHAPE, value, np.float32), "bn.num_batches_tracked": np.array(4 * (index + 1))}
            assert core.accept(f"site-{site + 1}", arrays, {"n_samples": n}) is None
        result = core.aggregate()
        assert result.info[SERVER_OPT_INFO]["name"] == options["name"]
        params = result.params
        models.append(params)
    return models


def w(model: dict[str, np.ndarray]) -> float:
    assert model["w"].dtype == np.float32 and np.all(model["w"] == model["w"][0, 0])
    return float(model["w"][0, 0])


def adaptive_by_hand(second_moment) -> tuple[float, float]:  # noqa: ANN001 - (v, Δ²) -> v
    """x₁, x₂ of Algorithm 2 with η = 0.1, m₋₁ = 0, v₋₁ = τ², written out."""
    eta, m, v, x, xs = 0.1, 0.0, TAU ** 2, 0.0, []
    for delta in DELTAS:
        m = B1 * m + (1 - B1) * delta
        v = second_moment(v, delta * delta)
        x = x + eta * m / (math.sqrt(v) + TAU)
        xs.append(x)
    return xs[0], xs[1]


def test_fedadam_matches_algorithm_2_over_two_rounds() -> None:
    """Reddi et al. 2021, Algorithm 2 (FedAdam): v = β₂v + (1 − β₂)Δ², x = x + η m/(√v + τ)."""
    # Prepare: round 1: m = 0.2, v = 0.99e-6 + 0.04; round 2: m = 0.08, v = 0.99 v₁ + 0.01
    expected = (0.1 * 0.2 / (math.sqrt(0.99e-6 + 0.04) + TAU),)
    expected += (expected[0] + 0.1 * 0.08 / (math.sqrt(0.99 * (0.99e-6 + 0.04) + 0.01) + TAU),)
    # Execute
    models = two_rounds({"name": "fedadam", "lr": 0.1})
    # Assert
    assert [w(m) for m in models] == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(adaptive_by_hand(lambda v, sq: B2 * v + (1 - B2) * sq))


def test_fedyogi_moves_v_by_the_sign_of_v_minus_the_squared_step() -> None:
    """Reddi et al. 2021, Algorithm 2 (FedYogi): v = v − (1 − β₂)Δ² sign(v − Δ²); v grows by 0.04, then 0.01."""
    v1 = 1e-6 + 0.01 * 4  # sign(1e-6 − 4) = −1
    v2 = v1 + 0.01 * 1  # sign(v₁ − 1) = −1: Yogi adds, where Adam would shrink v₁ by β₂
    x1 = 0.1 * 0.2 / (math.sqrt(v1) + TAU)
    models = two_rounds({"name": "fedyogi", "lr": 0.1})
    assert [w(m) for m in models] == pytest.approx((x1, x1 + 0.1 * 0.08 / (math.sqrt(v2) + TAU)), rel=1e-6)


def test_fedyogi_shrinks_v_when_the_step_is_smaller_than_its_scale() -> None:
    """sign(v − Δ²) = +1 once v > Δ²: a large first step (Δ₁ = 2, v₁ = 0.040001) then Δ₂ = −0.1: v₂ = v₁ − 1e-4."""
    core = RoundAggregation(get_method("fedavg"), {}, 3, 2, server_optimizer={"name": "fedyogi", "lr": 0.1})
    core.start_round(START, RoundContext(0, 2))
    core.start_phase("train")
    core.accept("site-1", {"w": np.full(SHAPE, 2.0, np.float32), "bn.num_batches_tracked": np.array(1)},
                {"n_samples": 5})
    first = core.aggregate().params
    core.start_round(first, RoundContext(1, 2))
    core.start_phase("train")
    x1 = float(first["w"][0, 0])
    sent = np.full(SHAPE, x1 - 0.1, np.float32)
    core.accept("site-1", {"w": sent, "bn.num_batches_tracked": np.array(2)}, {"n_samples": 5})
    second = core.aggregate().params
    delta = float(sent[0, 0]) - x1  # −0.1 as float32 sends it
    v2 = 1e-6 + 0.04 - 0.01 * delta ** 2
    m2 = 0.9 * 0.2 + 0.1 * delta
    assert float(second["w"][0, 0]) == pytest.approx(x1 + 0.1 * m2 / (math.sqrt(v2) + TAU), rel=1e-6)


def test_fedadagrad_sums_every_squared_step() -> None:
    """Reddi et al. 2021, Algorithm 2 (FedAdagrad): v = v + Δ²: v₁ = τ² + 4, v₂ = τ² + 5."""
    x1 = 0.1 * 0.2 / (math.sqrt(1e-6 + 4) + TAU)
    models = two_rounds({"name": "fedadagrad", "lr": 0.1})
    assert [w(m) for m in models] == pytest.approx((x1, x1 + 0.1 * 0.08 / (math.sqrt(1e-6 + 5) + TAU)), rel=1e-6)


def test_fedavgm_accumulates_server_momentum() -> None:
    """Hsu et al. 2019, §3: v = βv + Δ, x = x + ηv with β = 0.9, η = 1: v₁ = 2, x₁ = 2; v₂ = 1.8 − 1, x₂ = 2.8
    (plain FedAvg would give 1.0)."""
    models = two_rounds({"name": "fedavgm"})
    assert [w(m) for m in models] == pytest.approx((2.0, 2.8), rel=1e-6)


def test_integer_buffers_take_the_plain_average() -> None:
    """BatchNorm's num_batches_tracked is no weight: the aggregate, never a step (Δ = 4 would move it)."""
    for name in ("fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        models = two_rounds({"name": name})
        assert [int(m["bn.num_batches_tracked"]) for m in models] == [4, 8], name
        assert all(m["bn.num_batches_tracked"].dtype == np.int64 for m in models)


def test_the_step_is_on_the_bounded_aggregate() -> None:
    """With robust.max_share = 0.5 two sites at 1.0 (n = 10) and 4.0 (n = 30) weigh 1/2 each: the aggregate is 2.5
    (not the sample-weighted 3.25), and FedAvgM with β = 0.9, η = 1 takes Δ₁ = 2.5 (x₁ = 2.5), then Δ₂ = −1:
    x₂ = 2.5 + 0.9 · 2.5 − 1."""
    models = two_rounds({"name": "fedavgm"}, robust={"max_share": 0.5}, sent=(1.0, 4.0), samples=(10, 30))
    assert [w(m) for m in models] == pytest.approx((2.5, 2.5 + 2.25 - 1.0), rel=1e-6)


def test_the_streamed_sum_is_stepped_too() -> None:
    """stream_aggregation sums results as they arrive; the server optimizer steps on that sum alike."""
    core = RoundAggregation(get_method("fedavg"), {}, 3, 2, stream_aggregation=True,
                            server_optimizer={"name": "fedavgm", "lr": 0.5})
    core.start_round(START, RoundContext(0, 2))
    core.start_phase("train")
    core.expect_sites(["site-1"])
    core.accept("site-1", {"w": np.full(SHAPE, 2.0, np.float32), "bn.num_batches_tracked": np.array(1)},
                {"n_samples": 5})
    result = core.aggregate()
    assert result.info["stream_aggregation"]["mode"] == "streamed"
    np.testing.assert_allclose(result.params["w"], 1.0)  # η · Δ = 0.5 · 2


def test_defaults_are_the_papers() -> None:
    """Reddi et al. 2021, §5 (Experimental setup): β₁ = 0.9, β₂ = 0.99; τ = 1e-3 (Flower's FedYogi default; the
    paper tunes τ per task, Table 2); η: Flower's FedAdam/FedAdagrad 1e-1, FedYogi 1e-2 (the paper tunes η per task);
    FedAvgM: server learning rate 1, momentum 0.9 (Hsu et al. 2019, §3 and §4)."""
    config = ServerOptConfig()
    assert (config.name, config.beta1, config.beta2, config.tau, config.momentum) == ("none", 0.9, 0.99, 1e-3, 0.9)
    assert DEFAULT_LR == {"fedavgm": 1.0, "fedadam": 0.1, "fedyogi": 0.01, "fedadagrad": 0.1}
    assert ServerOptConfig(name="fedyogi").step_size == 0.01 and ServerOptConfig(name="fedadam", lr=0.3).step_size == 0.3


@pytest.mark.parametrize("settings, words", [
    ({"name": "fedadam", "eta": 0.1}, "unknown option(s) eta"),
    ({"name": "fedsgd"}, "must be one of"),
    ({"name": "fedadam", "beta2": 1.0}, "server_optimizer.beta2 must be"),
    ({"name": "fedadam", "tau": 0}, "server_optimizer.tau must be"),
    ({"name": "fedavgm", "beta1": 0.5}, "not read by server_optimizer.name=fedavgm"),
    ({"name": "fedadam", "momentum": 0.5}, "not read by server_optimizer.name=fedadam"),
])
def test_bad_options_are_refused_in_one_line(settings: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        typed_server_optimizer(settings)
