"""MDH-FL (and FedMD, which runs the same exchange): the T_p shortcut, CCR weights, the server's checks of the
exchange (malformed probabilities, public-set digests, per-site targets) and the site's distillation steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from medflare.data import DataConfig, make_site_data
from medflare.errors import ConfigError, PayloadError
from medflare.losses import kl_to_teacher
from medflare.methods.base import PerSite, RoundContext, TrainConfig
from medflare.methods.mdhfl import MdhflConfig
from medflare.methods.mdhfl.protocol import (
    DISTILL_PHASE,
    KL_LOSS,
    PRIVATE_LOSS,
    PROBS,
    PROBS_PHASE,
    PUBLIC_DIGEST,
    PUBLIC_ROWS,
    PUBLIC_SIZE,
    SETUP_PHASE,
    TARGET,
)
from medflare.methods.mdhfl.server import PublicSetMismatch, chunk_bounds
from medflare.methods.mdhfl.targets import ccr_weights, mean_weights, mixed_target_loss, mixed_targets
from medflare.models import create_model
from medflare.plan import validated
from medflare.registry import get_method
from medflare.run_config import RunConfig
from medflare.server_round import RoundAggregation

from .._plans import run_plan

K = 3
DIGEST = "ab" * 32


# ----- the T_p shortcut ------------------------------------------------------------------------------------
@pytest.mark.parametrize("include_self", [False, True])
def test_the_mixed_target_gives_the_gradient_of_the_weighted_kl_sum(include_self: bool) -> None:
    """Σ_i w_i·KL(t_i ‖ softmax(z)) and −Σ_c T_c log softmax(z)_c with T = Σ_i w_i t_i have the same gradient in
    z (autograd, float64), and their values differ by the constant Σ_i w_i Σ_c t_i,c log t_i,c."""
    generator = torch.Generator().manual_seed(0)
    teachers = {f"site-{i}": torch.softmax(torch.randn(6, K, generator=generator, dtype=torch.float64), 1)
                for i in range(1, 5)}
    weights = {"site-1": 0.1, "site-2": 0.2, "site-3": 0.3, "site-4": 0.4}
    logits = torch.randn(6, K, generator=generator, dtype=torch.float64, requires_grad=True)
    others = {s: t for s, t in teachers.items() if include_self or s != "site-1"}

    explicit = sum(weights[s] * kl_to_teacher(logits, t) for s, t in others.items())
    (explicit_grad,) = torch.autograd.grad(explicit, logits)
    targets = mixed_targets({s: t.numpy() for s, t in teachers.items()}, weights, include_self)
    shortcut = mixed_target_loss(logits, torch.as_tensor(targets["site-1"]))
    (shortcut_grad,) = torch.autograd.grad(shortcut, logits)

    torch.testing.assert_close(shortcut_grad, explicit_grad, rtol=0, atol=1e-12)
    constant = sum(weights[s] * (t * t.log()).sum(1).mean() for s, t in others.items())
    assert (shortcut + constant).item() == pytest.approx(explicit.item(), abs=1e-12)


def test_a_site_target_leaves_out_its_own_predictions_and_fedmd_averages_everyone() -> None:
    probs = {"a": np.array([[1.0, 0, 0]]), "b": np.array([[0, 1.0, 0]]), "c": np.array([[0, 0, 1.0]])}
    mdhfl = mixed_targets(probs, mean_weights(list(probs), include_self=False))
    np.testing.assert_allclose(mdhfl["a"], [[0, 0.5, 0.5]])  # the paper's Eq. 3: 1/(P−1) over the others
    fedmd = mixed_targets(probs, mean_weights(list(probs), include_self=True), include_self=True)
    for target in fedmd.values():
        np.testing.assert_allclose(target, [[1 / 3, 1 / 3, 1 / 3]])
    assert mixed_targets({"a": probs["a"]}, {"a": 1.0}) == {}  # nobody to learn from


# ----- CCR --------------------------------------------------------------------------------------------------
def test_ccr_weights_match_a_hand_computed_case() -> None:
    previous = {"a": 1.0, "b": 2.0, "c": 1.5}
    current = {"a": 0.5, "b": 1.0, "c": 1.5}
    # q = (1.0, 1.0, 0.0), Σq = 2, a = 1/2 + 0.5·q/2 = (0.75, 0.75, 0.5), w = softmax(a)
    denominator = 2 * math.exp(0.75) + math.exp(0.5)
    expected = {"a": math.exp(0.75) / denominator, "b": math.exp(0.75) / denominator, "c": math.exp(0.5) / denominator}
    weights = ccr_weights(["a", "b", "c"], previous, current, beta=0.5)
    assert weights == pytest.approx(expected, abs=1e-12)
    assert weights["a"] == pytest.approx(0.359868, abs=1e-6)


def test_ccr_weights_first_round_guard_and_missing_losses() -> None:
    sites = ["a", "b", "c"]
    assert ccr_weights(sites, {}, {"a": 1.0, "b": 1.0, "c": 1.0}, beta=0.5) == pytest.approx(
        {"a": 0.5, "b": 0.5, "c": 0.5})  # the code's round 0: 1/(P−1)
    near_zero = ccr_weights(sites, {"a": 1.0 + 1e-9, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, beta=0.5)
    assert near_zero == pytest.approx({s: 1 / 3 for s in sites}, abs=1e-12)  # Σq⁺ = 1e-9 < eps
    partial = ccr_weights(sites, {"a": 2.0}, {"a": 1.0, "b": 1.0}, beta=0.5)
    # q = (1, 0, 0): a = (1, 0.5, 0.5)
    denominator = math.exp(1.0) + 2 * math.exp(0.5)
    assert partial["a"] == pytest.approx(math.exp(1.0) / denominator, abs=1e-12)
    assert ccr_weights(sites, {"a": 2.0}, {"a": 1.0}, beta=0.0) == pytest.approx({s: 1 / 3 for s in sites})


def test_ccr_guard_counts_only_loss_drops() -> None:
    """RHFL's q_p/Σq is unbounded near Σq = 0 and inverts when every loss rises; the guard keeps the β term in
    [0, β] (spec §3(a) step 2: clip the denominator or fall back to uniform)."""
    sites = ["a", "b", "c"]
    # a's loss falls by 10 %, b's rises by 10 %: RHFL's Σq = 0 would drop the β term; the guard rewards a alone
    mixed = ccr_weights(sites, {"a": 1.1, "b": 0.9, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, beta=0.5)
    denominator = math.exp(1.0) + 2 * math.exp(0.5)  # q⁺ = (0.1, 0, 0): a = (1, 0.5, 0.5)
    assert mixed["a"] == pytest.approx(math.exp(1.0) / denominator, abs=1e-12)
    assert mixed["b"] == pytest.approx(mixed["c"], abs=1e-12)
    # every loss rises: RHFL's ratio would reward the worst site (q = −0.5 / Σq = −0.6); the guard is uniform
    rising = ccr_weights(sites, {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 2.0, "b": 1.05, "c": 1.05}, beta=0.5)
    assert rising == pytest.approx({s: 1 / 3 for s in sites}, abs=1e-12)
    # the probe: one site's loss chosen so that Σq sits just above eps took all the weight; now at most e^β more
    # (honest q = −0.1, −0.1; the attacker's q = 0.2 + 1e-5, so Σq = 1e-5 and RHFL gives it a weight of 1.0)
    steered = ccr_weights(sites, {"a": 0.9, "b": 0.9, "c": 1.2 + 1e-5}, {"a": 1.0, "b": 1.0, "c": 1.0}, beta=0.5)
    assert steered["c"] == pytest.approx(math.exp(1.0) / denominator, abs=1e-9)
    assert max(steered.values()) / min(steered.values()) <= math.exp(0.5) + 1e-12


def test_chunks_cover_the_rows_of_a_round_once_and_rounds_rotate() -> None:
    rows = [chunk_bounds(1, m, public_size=10, per_round=7, chunks=3) for m in range(3)]
    assert rows == [(7, 2), (9, 2), (1, 3)]  # round 1 starts at row 7 and wraps around the 10 images
    covered = [(first + i) % 10 for first, count in rows for i in range(count)]
    assert covered == [7, 8, 9, 0, 1, 2, 3]


# ----- the server's side of the exchange -------------------------------------------------------------------
def server(method: str = "mdhfl", **method_args) -> RoundAggregation:
    return RoundAggregation(get_method(method), {"public_per_round": 8, **method_args}, num_classes=K, num_rounds=3)


def set_up(core: RoundAggregation, sites: dict[str, str], size: int = 20, round_index: int = 0) -> np.ndarray:
    """Run the set-up phase with the given digests and open the first probabilities phase."""
    core.start_round({}, RoundContext(round_index, 3))
    assert core.start_phase(SETUP_PHASE) == {}
    for site, digest in sites.items():
        assert core.accept(site, {}, {PUBLIC_DIGEST: digest, PUBLIC_SIZE: size}) is None
    return core.start_phase(PROBS_PHASE)[PUBLIC_ROWS]


def probs(rows: int, seed: int, dtype=np.float16) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(rows, K))
    return (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(dtype)


def test_a_mismatched_public_set_stops_the_exchange_naming_the_site() -> None:
    core = server()
    core.start_round({}, RoundContext(0, 3))
    core.start_phase(SETUP_PHASE)
    for site, digest in {"site-1": DIGEST, "site-2": "cd" * 32, "site-3": DIGEST}.items():
        core.accept(site, {}, {PUBLIC_DIGEST: digest, PUBLIC_SIZE: 20})
    with pytest.raises(PublicSetMismatch, match=r"public set mismatch: site-2 hold\(s\) a different copy .* site-1, "
                                                r"site-3 .* fix data.public_source at site-2"):
        core.start_phase(PROBS_PHASE)


def test_a_malformed_digest_or_size_is_rejected_at_set_up() -> None:
    core = server()
    core.start_round({}, RoundContext(0, 3))
    core.start_phase(SETUP_PHASE)
    assert "SHA-256" in core.accept("site-1", {}, {PUBLIC_DIGEST: "AB" * 32, PUBLIC_SIZE: 20})
    assert "SHA-256" in core.accept("site-2", {}, {PUBLIC_DIGEST: DIGEST + " secret", PUBLIC_SIZE: 20})
    assert "whole number" in core.accept("site-3", {}, {PUBLIC_DIGEST: DIGEST, PUBLIC_SIZE: 20.5})


def test_malformed_probability_payloads_are_rejected() -> None:
    core = server()
    rows = set_up(core, {f"site-{i}": DIGEST for i in range(1, 9)})
    n = int(rows[1])
    assert core.task_header()["array_dims"] == {"rows": n}
    nan = probs(n, 4)
    nan[2, 1] = np.nan
    bad_rows = probs(n, 5).astype(np.float32)
    bad_rows[0] = [0.5, 0.5, 0.5]
    cases = {
        "site-1": (probs(n + 1, 1), "shape"),
        "site-2": (probs(n, 2)[:, :2], "shape"),
        "site-3": (np.full((n, K), 2.0, np.float16), "above 1"),
        "site-4": (np.full((n, K), -0.5, np.float32), "below 0"),
        "site-5": (bad_rows, "sum to 1"),
        "site-6": (nan, "NaN"),
        "site-7": (probs(n, 7, np.float64), "dtype"),
    }
    for site, (array, reason) in cases.items():
        assert reason in core.accept(site, {PROBS: array}, {PRIVATE_LOSS: 1.0}), site
    assert core.accept("site-8", {PROBS: probs(n, 8, np.float32)}, {PRIVATE_LOSS: 1.0}) is None  # fp32 option
    assert set(core.rejected) == {f"site-{i}" for i in range(1, 8)}


def test_each_site_receives_only_its_own_target_and_a_missing_site_is_dropped_from_the_targets() -> None:
    core = server(chunks=2)
    rows = set_up(core, {"site-1": DIGEST, "site-2": DIGEST, "site-3": DIGEST})
    assert rows.tolist() == [0, 4]
    sent = {site: probs(4, seed) for seed, site in enumerate(("site-1", "site-2"))}  # site-3 does not answer
    for site, array in sent.items():
        assert core.accept(site, {PROBS: array}, {PRIVATE_LOSS: 1.0}) is None
    distill = core.start_phase(DISTILL_PHASE)
    assert isinstance(distill, PerSite) and set(distill.arrays) == {"site-1", "site-2"}
    for site, other in (("site-1", "site-2"), ("site-2", "site-1")):  # round 0: w = 1/(P−1) = 1 for the other
        assert set(distill.arrays[site]) == {TARGET}
        np.testing.assert_allclose(distill.arrays[site][TARGET].astype(np.float64), sent[other], atol=1e-3)
    for site in ("site-1", "site-2"):
        assert core.accept(site, {}, {KL_LOSS: 0.5}) is None
    assert core.start_phase(PROBS_PHASE)[PUBLIC_ROWS].tolist() == [4, 4]
    for site in ("site-1", "site-2", "site-3"):
        assert core.accept(site, {PROBS: probs(4, 9)}, {}) is None
    train = core.start_phase("train")
    assert set(train.arrays) == {"site-1", "site-2", "site-3"} and all(TARGET in a for a in train.arrays.values())
    for site in train.arrays:
        assert core.accept(site, {}, {"n_samples": 10}) is None
    result = core.aggregate()
    assert result.params == {} and result.info["targets_for"] == [["site-1", "site-2"], ["site-1", "site-2", "site-3"]]


def test_a_site_that_sent_no_probabilities_still_trains_without_a_target() -> None:
    core = server()
    set_up(core, {"site-1": DIGEST, "site-2": DIGEST, "site-3": DIGEST})
    for seed, site in enumerate(("site-1", "site-2")):
        core.accept(site, {PROBS: probs(8, seed)}, {PRIVATE_LOSS: 1.0})
    train = core.start_phase("train")
    assert train.arrays["site-3"] == {} and TARGET in train.arrays["site-1"]


def test_a_site_unchecked_at_set_up_takes_no_part_in_the_exchange() -> None:
    core = server()
    set_up(core, {"site-1": DIGEST, "site-2": DIGEST})
    for seed, site in enumerate(("site-1", "site-2", "site-3")):  # site-3 missed the set-up
        assert core.accept(site, {PROBS: probs(8, seed)}, {PRIVATE_LOSS: 1.0}) is None
    train = core.start_phase("train")
    assert train.arrays["site-3"] == {}  # it trains locally, without a target
    np.testing.assert_allclose(train.arrays["site-1"][TARGET].astype(np.float64), probs(8, 1), atol=1e-3)


def test_ccr_weights_use_the_previous_rounds_losses() -> None:
    core = server()
    set_up(core, {"site-1": DIGEST, "site-2": DIGEST, "site-3": DIGEST})
    for round_index, losses in ((0, (1.0, 2.0, 1.5)), (1, (0.5, 1.0, 1.5))):
        if round_index:
            core.start_round({}, RoundContext(round_index, 3))
            core.start_phase(PROBS_PHASE)
        for seed, (site, loss) in enumerate(zip(("site-1", "site-2", "site-3"), losses)):
            core.accept(site, {PROBS: probs(8, seed)}, {PRIVATE_LOSS: loss})
        core.start_phase("train")
    assert core.rule.round_info([], core.ctx)["weights"][0] == pytest.approx(
        ccr_weights(["site-1", "site-2", "site-3"], {"site-1": 1.0, "site-2": 2.0, "site-3": 1.5},
                    {"site-1": 0.5, "site-2": 1.0, "site-3": 1.5}, beta=0.5))


def test_phases_follow_the_chunks_and_the_set_up_is_round_zero_only() -> None:
    rule = server(chunks=3).rule
    assert rule.phases(RoundContext(0, 3)) == [SETUP_PHASE] + [PROBS_PHASE, DISTILL_PHASE] * 2 + [PROBS_PHASE, "train"]
    assert rule.phases(RoundContext(1, 3)) == [PROBS_PHASE, DISTILL_PHASE] * 2 + [PROBS_PHASE, "train"]
    assert server(distill=False).rule.phases(RoundContext(0, 3)) == ["train"]  # the "w/o KL" ablation


def test_too_many_chunks_for_the_public_rows_fail_with_the_option_names() -> None:
    """At set-up when only the public set's size decides (8 rows, whole set per round); before anything starts
    when public_per_round alone does."""
    core = server(chunks=5, public_per_round=0)
    with pytest.raises(ConfigError, match="method.chunks=5"):
        set_up(core, {"site-1": DIGEST, "site-2": DIGEST}, size=8)
    with pytest.raises(ConfigError, match="method.chunks=5 splits method.public_per_round=8"):
        MdhflConfig(chunks=5, public_per_round=8)
    assert MdhflConfig(chunks=5, public_per_round=8, distill=False).chunks == 5  # no exchange, nothing to split


# ----- what the run's options alone decide fails before anything starts ----------------------------------------
def simulated_run(method: str, **changes) -> RunConfig:
    data = {"source": "synthetic:n=60", **changes.pop("data", {})}
    return RunConfig(method=method, data=data, **changes)


@pytest.mark.parametrize("method", ["mdhfl", "fedmd"])
def test_a_simulation_without_a_public_set_is_refused_before_anything_starts(method: str) -> None:
    """Issue 27: `medflare run mdhfl --data synthetic` launched FLARE and failed at the sites' first task."""
    with pytest.raises(ConfigError, match=f"method '{method}': .*set data.public_fraction"):
        run_plan(simulated_run(method))
    run_plan(simulated_run(method, data={"public_fraction": 0.2}))
    run_plan(simulated_run(method, data={"public_source": "synthetic:n=40"}))
    run_plan(simulated_run(method, method_args={"distill": False}))  # the "w/o KL" ablation exchanges nothing
    site_task = {"num_classes": 2, "in_channels": 1, "image_size": 28}
    run_plan(RunConfig(method=method, data={"source": "site"}, task=site_task))  # each site names its public_source


@pytest.mark.parametrize(
    ("options", "message"),
    [({"weighting": "median"}, "weighting"), ({"chunks": 0}, "chunks"), ({"probs_dtype": "float64"}, "probs_dtype"),
     ({"loss": "bsm"}, "loss"), ({"ccr_beta": -1.0}, "ccr_beta")],
)
def test_bad_options_fail_early(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MdhflConfig(**options)


# ----- the site's side ------------------------------------------------------------------------------------
def site_trainer(method: str = "mdhfl", n: int = 60, sites: int = 2, **method_args):
    cfg = DataConfig(source=f"synthetic:n={n},classes={K},size=12,n_val=9,n_test=9", num_sites=sites,
                     public_fraction=0.4, augment="none")
    data = make_site_data(cfg, 0)
    spec = get_method(method)
    torch.manual_seed(0)
    model = create_model("cnn", K, 3, image_size=12)
    train = TrainConfig(**{**spec.train_defaults, "batch_size": 8})
    return spec.trainer_cls(model, data, train, spec.config_cls(**method_args), spec.payload, torch.device("cpu"),
                            log=lambda m: None)


def test_probabilities_cover_the_chunk_rows_sum_to_one_and_carry_the_loss_once_a_round() -> None:
    trainer = site_trainer()
    ctx = RoundContext(0, 2)
    arrays, meta = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([20, 8])}, ctx)
    assert arrays[PROBS].dtype == np.float16 and arrays[PROBS].shape == (8, K)
    np.testing.assert_allclose(arrays[PROBS].astype(np.float64).sum(1), 1.0, atol=5e-3)
    assert set(meta) == {PRIVATE_LOSS} and meta[PRIVATE_LOSS] > 0
    _, again = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([4, 8])}, ctx)
    assert again == {}  # the second chunk of the round sends no loss
    assert trainer.rows == (4, 8)
    fp32 = site_trainer(probs_dtype="float32").run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([20, 8])}, ctx)[0]
    assert fp32[PROBS].dtype == np.float32
    np.testing.assert_allclose(fp32[PROBS], arrays[PROBS].astype(np.float32), atol=1e-3)  # rows 20..23 wrap to 0..3
    assert site_trainer(method="fedmd").run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, ctx)[1] == {}


@pytest.mark.parametrize("kl_optimizer", ["step", "persistent"])
def test_a_fresh_adam_per_kl_step_moves_every_weight_by_the_learning_rate_each_step(kl_optimizer: str) -> None:
    """The authors' optimizer semantics: a new Adam each step, so each step is ≈ lr·sign(gradient) and two steps
    move a weight by 0 or 2·lr; an Adam kept across the steps does not."""
    trainer = site_trainer(kl_optimizer=kl_optimizer)
    trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 16])}, RoundContext(0, 2))  # two steps of 8
    before = [p.detach().clone() for p in trainer.model.parameters()]
    target = np.full((16, K), 1 / K, np.float16)
    _, meta = trainer.run_phase(DISTILL_PHASE, {TARGET: target}, RoundContext(0, 2))
    assert meta[KL_LOSS] > 0
    moved = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(trainer.model.parameters(), before)])
    on_grid = ((moved - 2e-3).abs() < 2e-5) | (moved < 2e-5)
    if kl_optimizer == "step":
        assert on_grid.float().mean() > 0.95 and (moved > 1e-3).float().mean() > 0.2  # 0: the two signs differed
        assert trainer.kl_optimizer is None  # nothing carried over
    else:
        assert on_grid.float().mean() < 0.5


def test_a_persistent_kl_optimizer_keeps_its_moments_across_chunks() -> None:
    trainer = site_trainer(kl_optimizer="persistent", n=100)
    for first in (0, 16):
        trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([first, 16])}, RoundContext(0, 2))
        trainer.run_phase(DISTILL_PHASE, {TARGET: np.full((16, K), 1 / K, np.float16)}, RoundContext(0, 2))
    steps = {int(state["step"]) for state in trainer.kl_optimizer.state_dict()["state"].values()}
    assert steps == {4}  # two chunks of 16 rows at batch 8, one optimizer
    restored = site_trainer(kl_optimizer="persistent", n=100)
    restored.load_extra_state(trainer.extra_state())
    assert restored.rows == (16, 16) and restored.kl_optimizer.state_dict()["state"][0]["step"] == 4


def test_the_site_refuses_a_target_it_cannot_trust() -> None:
    trainer = site_trainer()
    ctx = RoundContext(0, 2)
    with pytest.raises(PayloadError, match="before any public probabilities"):
        trainer.run_phase(DISTILL_PHASE, {TARGET: np.zeros((8, K), np.float32)}, ctx)
    trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, ctx)
    with pytest.raises(PayloadError, match="shape"):
        trainer.run_phase(DISTILL_PHASE, {TARGET: np.zeros((9, K), np.float32)}, ctx)
    with pytest.raises(PayloadError, match="above"):
        trainer.run_phase(DISTILL_PHASE, {TARGET: np.full((8, K), 7.0, np.float32)}, ctx)
    with pytest.raises(PayloadError, match="public_rows"):
        trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 999])}, ctx)


def test_local_epochs_follow_the_authors_rule_unless_set() -> None:
    trainer = site_trainer(n=200, sites=4)  # 80 public images, 120 private over 4 sites: 80 // 30 = 2
    assert (len(trainer.data.public), len(trainer.data.train)) == (80, 30)
    assert trainer.train_cfg.local_epochs == 2
    assert site_trainer(n=200, sites=4, public_per_round=40).train_cfg.local_epochs == 1  # 40 rows a round
    assert site_trainer(n=200, local_epochs=3).train_cfg.local_epochs == 3
    spec = get_method("mdhfl")
    asked = spec.trainer_cls(trainer.model, trainer.data, TrainConfig(local_epochs=4), MdhflConfig(), spec.payload,
                             torch.device("cpu"))
    assert asked.train_cfg.local_epochs == 4  # --local-epochs wins over the authors' rule


def test_pretraining_trains_the_local_model_before_the_first_exchange() -> None:
    trainer = site_trainer(pretrain_epochs=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.run_phase(SETUP_PHASE, {}, RoundContext(0, 2))
    assert any(not torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))
    untouched = site_trainer()
    before = [p.detach().clone() for p in untouched.model.parameters()]
    untouched.run_phase(SETUP_PHASE, {}, RoundContext(0, 2))
    assert all(torch.equal(p, b) for p, b in zip(untouched.model.parameters(), before))


def test_the_noisy_heterogeneous_scenario_runs_only_methods_that_send_no_weights() -> None:
    from medflare.console.scenarios import load_scenario
    from medflare.run_config import RunConfig, merge_sections

    scenario = load_scenario("noisy-heterogeneous")
    for method in ("mdhfl", "fedmd", "local-only"):
        validated(RunConfig(**merge_sections(scenario, {"method": method})))
    with pytest.raises(ConfigError, match="per-site models"):
        validated(RunConfig(**merge_sections(scenario, {"method": "fedavg"})))


def test_the_setup_reports_the_digest_and_size_of_the_public_copy() -> None:
    from medflare.data.public import public_digest

    trainer = site_trainer()
    arrays, meta = trainer.run_phase(SETUP_PHASE, {}, RoundContext(0, 2))
    assert arrays == {} and meta == {PUBLIC_DIGEST: public_digest(trainer.data.public.images),
                                     PUBLIC_SIZE: len(trainer.data.public)}


# ----- the paper's defaults (issue 51, item 3) --------------------------------------------------------------------
def test_defaults_are_the_papers_and_the_codes_where_the_card_says_so() -> None:
    """spec §3: SCE with α (the paper's λ, CE's weight) 0.1 and β 1.0; CCR with β 0.5 (the code's RHFL weighting);
    KL toward the other sites (not a site's own predictions); one exchange a round over the whole public set by
    default (FedMD-like, spec §3 staleness); no warm-up (MDH-FL has none); Adam 1e-3, batch 16, a new Adam per KL
    step (the code's)."""
    cfg = MdhflConfig()
    assert (cfg.loss, cfg.sce_alpha, cfg.sce_beta, cfg.distill) == ("sce", 0.1, 1.0, True)
    assert (cfg.weighting, cfg.ccr_beta, cfg.include_self) == ("ccr", 0.5, False)
    assert (cfg.chunks, cfg.public_per_round, cfg.pretrain_epochs, cfg.kl_optimizer) == (1, 0, 0, "step")
    train = get_method("mdhfl").train_defaults
    assert (train["optimizer"], train["lr"], train["batch_size"]) == ("adam", 1e-3, 16)
