"""The trust probe's cases, each against the server's round core: a hostile site may be refused, or counted, but never
above the job's share cap in any part of any aggregate, and never with a value that breaks the next round."""

from dataclasses import replace

import numpy as np
import pytest

from medflare import contracts
from medflare.errors import ConfigError
from medflare.methods.base import LARGEST_SHARE, RoundContext, ServerRule, SiteUpdate
from medflare.methods.fedlsm.server import LABEL_COUNTS, NEGATIVES, POS_WEIGHT, POSITIVES
from medflare.methods.mdhfl.protocol import (
    PRIVATE_LOSS,
    PROBS,
    PROBS_PHASE,
    PUBLIC_DIGEST,
    PUBLIC_SIZE,
    SETUP_PHASE,
    TARGET,
)
from medflare.registry import get_method, list_methods, register_method
from medflare.server_round import RoundAggregation

K = 3
ROBUST = {"max_norm_ratio": 10, "max_share": 0.6}
GLOBAL = {
    "backbone.w": np.zeros(4, np.float32),
    "head.weight": np.zeros((K, 2), np.float32),
    "head.bias": np.zeros(K, np.float32),
    "bn.num_batches_tracked": np.array(0, np.int64),
}


def weights(value: float, counter: int = 2) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, value) if v.dtype.kind == "f" else np.array(counter, np.int64)
            for k, v in GLOBAL.items()}


def train_core(method: str, robust: dict | None, method_args: dict | None = None, multi_label: bool = False):
    core = RoundAggregation(get_method(method), method_args or {}, num_classes=K, num_rounds=2, robust=robust,
                            multi_label=multi_label)
    core.start_round(GLOBAL, RoundContext(0, 2))
    return core


def attacker_head_share(result_head: np.ndarray, attacker_value: float, honest_value: float) -> float:
    """The attacker's weight on the head, read off the aggregate (honest sites all send ``honest_value``)."""
    return float(np.max((result_head - honest_value) / (attacker_value - honest_value)))


# ----- FedLSM (AWPA): q -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [[1e12] * K, [1e300] * K, [2.5, 1.0, 1.0], [-1.0, 1.0, 1.0]])
def test_fedlsm_counts_that_are_not_bounded_whole_counts_are_refused(q: list[float]) -> None:
    for robust in (ROBUST, None):
        core = train_core("fedlsm", robust)
        core.start_phase("train")
        reason = core.accept("attacker", weights(100.0), {contracts.N_SAMPLES: 10, "q": q})
        assert reason and "'q'" in reason


@pytest.mark.parametrize("robust, bounded", [(ROBUST, True), (None, False)])
def test_fedlsm_the_largest_valid_q_takes_at_most_the_cap_of_every_row(robust: dict | None, bounded: bool) -> None:
    """The probe: q = 1e12 made the global classifier the attacker's exactly while the scalar shares stayed 1/3."""
    core = train_core("fedlsm", robust)
    core.start_phase("train")
    for site in ("site-1", "site-2"):
        assert core.accept(site, weights(0.0), {contracts.N_SAMPLES: 10, "q": [10.0] * K}) is None
    assert core.accept("attacker", weights(100.0), {contracts.N_SAMPLES: 10, "q": [contracts.MAX_SAMPLES] * K}) is None
    result = core.aggregate()
    share = attacker_head_share(result.params["head.weight"], 100.0, 0.0)
    if bounded:
        assert share == pytest.approx(0.6, abs=1e-6)
        assert max(result.info[LARGEST_SHARE].values()) <= 0.6 + 1e-9
    else:  # robust off: no cap, as documented (docs/deploy-lead.md); the attacker owns the rows
        assert share > 0.99


# ----- FedAvg*: n_samples x mask -------------------------------------------------------------------------------
def test_fedavg_masked_rows_are_capped_like_the_scalar_share() -> None:
    """The probe: n = 1e8 with every class marked: scalar share capped at 0.6, head = the attacker's to 3e-7."""
    core = train_core("fedavg-masked", ROBUST)
    core.start_phase("train")
    for site in ("site-1", "site-2"):
        assert core.accept(site, weights(0.0), {contracts.N_SAMPLES: 100, "identified": [1.0] * K}) is None
    attack = {contracts.N_SAMPLES: contracts.MAX_SAMPLES, "identified": [1.0] * K}
    assert core.accept("attacker", weights(100.0), attack) is None
    result = core.aggregate()
    assert result.shares["attacker"] == pytest.approx(0.6)
    assert attacker_head_share(result.params["head.weight"], 100.0, 0.0) == pytest.approx(0.6, abs=1e-6)
    assert attacker_head_share(result.params["head.bias"], 100.0, 0.0) == pytest.approx(0.6, abs=1e-6)


# ----- FedLSM multi-label set-up ----------------------------------------------------------------------------------
def label_counts_core() -> RoundAggregation:
    core = train_core("fedlsm", ROBUST, multi_label=True)
    core.start_phase(LABEL_COUNTS)
    return core


def test_multi_label_counts_that_cannot_be_counts_are_refused() -> None:
    """The probe: negatives = [1e300] * 3 was accepted as a whole count, then every site trained with
    pos_weight = inf and a NaN loss."""
    core = label_counts_core()
    positives = np.array([5, 5, 5], np.int64)
    assert "above" in core.accept("site-1", {POSITIVES: positives, NEGATIVES: np.full(K, 1e300)}, {})
    inconsistent = {POSITIVES: positives, NEGATIVES: np.array([5, 6, 5], np.int64)}  # 10, 11, 10 images
    assert "inconsistent" in core.accept("site-2", inconsistent, {})


def test_the_largest_valid_counts_give_a_finite_pos_weight() -> None:
    core = label_counts_core()
    huge = {POSITIVES: np.array([1, 1, 1], np.int64), NEGATIVES: np.full(K, contracts.MAX_SAMPLES - 1, np.int64)}
    assert core.accept("site-1", huge, {}) is None
    pos_weight = core.start_phase("train")[POS_WEIGHT]
    assert np.all(np.isfinite(pos_weight)) and pos_weight.dtype == np.float32


def counts(positives: int, images: int) -> dict[str, np.ndarray]:
    return {POSITIVES: np.full(K, positives, np.int64), NEGATIVES: np.full(K, images - positives, np.int64)}


@pytest.mark.parametrize("robust, bounded", [(ROBUST, True), (None, False)])
def test_one_sites_counts_cannot_set_every_sites_pos_weight(robust: dict | None, bounded: bool) -> None:
    """Honest sites: 10 positives in 100 images (pos_weight 9). A site claiming 10⁸ images with one positive
    each class moved the global pos_weight to 4.8e6 for every site; with the cap its fractions count 0.6."""
    core = train_core("fedlsm", robust, multi_label=True)
    core.start_phase(LABEL_COUNTS)
    for site in ("site-1", "site-2"):
        assert core.accept(site, counts(10, 100), {}) is None
    assert core.accept("attacker", counts(1, contracts.MAX_SAMPLES), {}) is None
    pos_weight = core.start_phase("train")[POS_WEIGHT]
    expected = (0.2 * 0.9 * 2 + 0.6 * (1 - 1e-8)) / (0.2 * 0.1 * 2 + 0.6 * 1e-8) if bounded else (180 + 1e8 - 1) / 21
    assert pos_weight == pytest.approx(np.full(K, expected), rel=1e-5)


def test_n_samples_must_be_the_image_count_of_the_label_counts() -> None:
    core = label_counts_core()
    assert core.accept("site-1", counts(10, 100), {}) is None
    core.start_phase("train")
    forged = {contracts.N_SAMPLES: 10**6, "q": [1.0] * K}
    assert "differs from the 100 images" in core.accept("site-1", weights(1.0), forged)
    core.updates.clear()
    assert core.accept("site-1", weights(1.0), {contracts.N_SAMPLES: 100, "q": [1.0] * K}) is None


# ----- MDH-FL: teacher weights ------------------------------------------------------------------------------------
DIGEST = "ab" * 32


def one_hot_probs(rows: int, column: int) -> np.ndarray:
    probs = np.zeros((rows, K), np.float32)
    probs[:, column] = 1.0
    return probs


def mdhfl_targets(robust: dict | None, losses: dict[str, tuple[float, float]], **method_args) -> dict[str, np.ndarray]:
    """Two rounds of the exchange (the CCR needs a previous loss), each site sending a one-hot column of its own;
    each site's target of the second round."""
    core = RoundAggregation(get_method("mdhfl"), {"public_per_round": 4, **method_args}, num_classes=K, num_rounds=3,
                            robust=robust)
    for round_index in (0, 1):
        core.start_round({}, RoundContext(round_index, 3))
        if round_index == 0:
            core.start_phase(SETUP_PHASE)
            for site in losses:
                core.accept(site, {}, {PUBLIC_DIGEST: DIGEST, PUBLIC_SIZE: 8})
        rows = int(core.start_phase(PROBS_PHASE)["public_rows"][1])
        for column, (site, loss) in enumerate(losses.items()):
            assert core.accept(site, {PROBS: one_hot_probs(rows, column)}, {PRIVATE_LOSS: loss[round_index]}) is None
        outgoing = core.start_phase("train")
    return {site: arrays[TARGET].astype(np.float64) for site, arrays in outgoing.arrays.items() if arrays}


@pytest.mark.parametrize("robust", [ROBUST, None])
def test_mdhfl_a_steered_private_loss_cannot_make_one_teacher(robust: dict | None) -> None:
    """The probe: valid one-hot probabilities plus a private_loss that puts Σq just above ccr_eps gave the CCR
    weights {site-1: 0, site-2: 0, attacker: 1.0}."""
    losses = {"site-1": (0.9, 1.0), "site-2": (0.9, 1.0), "attacker": (1.2 + 1e-5, 1.0)}
    targets = mdhfl_targets(robust, losses)
    for receiver in ("site-1", "site-2"):
        target = targets[receiver]
        share = target[:, 2].mean() / target.sum(axis=1).mean()  # the attacker's one-hot column
        assert share <= np.exp(0.5) / (1 + np.exp(0.5)) + 1e-6  # the guard alone: at most e^β : 1
        if robust:
            assert share <= 0.6 + 1e-6


def test_the_share_cap_bounds_a_mix_the_ccr_alone_would_allow() -> None:
    """ccr_beta = 5 lets the CCR favour the fastest-learning site e^5 : 1; the job's cap still holds."""
    losses = {"site-1": (1.0, 1.0), "site-2": (1.0, 1.0), "fast": (2.0, 1.0)}
    for robust, bounded in ((ROBUST, True), (None, False)):
        target = mdhfl_targets(robust, losses, ccr_beta=5.0)["site-1"]
        share = target[:, 2].mean() / target.sum(axis=1).mean()  # "fast" sends the third column
        assert bool(share <= 0.6 + 1e-6) is bounded, share


# ----- FedBABU: a frozen part ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("transfer_dtype, kind", [("float32", "weights"), ("float16", "weights"), ("float32", "diff")])
def test_fedbabu_a_changed_frozen_head_is_refused(transfer_dtype: str, kind: str) -> None:
    """The probe: the frozen head came back as −3x the global and was averaged in."""
    start = {**GLOBAL, "head.weight": np.full((K, 2), 0.37, np.float32), "head.bias": np.full(K, 0.11, np.float32)}
    core = RoundAggregation(get_method("fedbabu"), {}, num_classes=K, num_rounds=2, transfer_dtype=transfer_dtype,
                            transfer_kind=kind)
    core.start_round(start, RoundContext(0, 2))
    core.start_phase("train")

    def sent(head_factor: float) -> dict[str, np.ndarray]:
        local = {**weights(1.0), "head.weight": start["head.weight"] * head_factor, "head.bias": start["head.bias"]}
        if kind == "diff":
            return {k: (v - start[k]).astype(transfer_dtype) for k, v in local.items() if v.dtype.kind == "f"}
        return {k: (v.astype(transfer_dtype) if v.dtype.kind == "f" else v) for k, v in local.items()}

    assert core.accept("honest", sent(1.0), {contracts.N_SAMPLES: 10}, kind) is None
    reason = core.accept("attacker", sent(-3.0), {contracts.N_SAMPLES: 10}, kind)
    assert reason and "'head.weight' is frozen" in reason
    np.testing.assert_array_equal(core.aggregate().params["head.weight"], start["head.weight"].astype(np.float32)
                                  if transfer_dtype == "float32" else start["head.weight"].astype(np.float16))


# ----- integer buffers ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counter", [2**63 - 1, -(10**18), -1, 2**53 + 2])
def test_integer_buffers_must_be_bounded_counters(counter: int) -> None:
    """The probe: num_batches_tracked = 2^63 − 1 at two sites wrapped to −2^63; −1e18 was accepted."""
    core = train_core("fedavg", None)
    core.start_phase("train")
    reason = core.accept("attacker", weights(0.0, counter=counter), {contracts.N_SAMPLES: 10})
    assert reason and "num_batches_tracked" in reason


def test_the_largest_valid_counters_average_without_wrapping() -> None:
    core = train_core("fedavg", None)
    core.start_phase("train")
    for site in ("site-1", "site-2"):
        assert core.accept(site, weights(0.0, counter=contracts.MAX_INTEGER_BUFFER), {contracts.N_SAMPLES: 10}) is None
    assert int(core.aggregate().params["bn.num_batches_tracked"]) == contracts.MAX_INTEGER_BUFFER


# ----- a new rule cannot get around the bound -----------------------------------------------------------------------
class RawRowsRule(ServerRule):
    """A rule that hands back raw, unnormalised row weights of its own making: all of row 0 to one site."""

    def row_weights(self, updates: list[SiteUpdate]) -> dict[str, dict[str, np.ndarray]]:
        return {"head.weight": {u.site: np.array([1e30 if u.site == "attacker" else 0.0, 1.0, 1.0]) for u in updates}}


class OwnAggregateRule(ServerRule):
    """A rule that tries to combine the sites itself."""

    def aggregate(self, global_params, updates, ctx, cap=0.0):  # noqa: ANN001, ANN201
        return super().aggregate(global_params, updates, ctx, cap)


@pytest.fixture(scope="module")
def raw_rules() -> None:
    """Register the two rules once per test process (the registry refuses a name twice)."""
    fedavg = get_method("fedavg")
    for name, rule in (("test-raw-rows", RawRowsRule), ("test-own-aggregate", OwnAggregateRule)):
        if name not in list_methods():
            register_method(replace(fedavg, name=name, server_rule_cls=rule))


def test_a_rule_returning_raw_row_weights_is_still_capped(raw_rules: None) -> None:
    core = train_core("test-raw-rows", ROBUST)
    core.start_phase("train")
    for site, value in (("site-1", 0.0), ("site-2", 0.0), ("attacker", 100.0)):
        assert core.accept(site, weights(value), {contracts.N_SAMPLES: 10}) is None
    head = core.aggregate().params["head.weight"]
    assert head[0] == pytest.approx(np.full(2, 60.0))  # the attacker's share of row 0: capped at 0.6
    assert head[1:] == pytest.approx(np.full((2, 2), 100 / 3), abs=1e-4)


def test_a_rule_that_overrides_aggregate_is_refused(raw_rules: None) -> None:
    with pytest.raises(ConfigError, match="overrides aggregate"):
        RoundAggregation(get_method("test-own-aggregate"), {}, num_classes=K, num_rounds=2)
