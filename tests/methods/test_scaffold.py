"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) through its real trainer and the server's round core:
the corrected local step, c_i⁺, what a site sends and keeps, and the server's bounded update of c, by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medflare import contracts
from medflare.errors import ConfigError, PayloadError
from medflare.methods.base import RoundContext
from medflare.methods.scaffold.control import DELTA_CONTROL, SERVER_CONTROL
from medflare.plan import resolve
from medflare.registry import get_method
from medflare.run_config import RunConfig
from medflare.server_round import RoundAggregation

from ._trainers import make_trainer
from .conftest import make_site

METHOD = "scaffold"
LR = 0.1  # make_trainer's plain full-batch SGD
# hand-picked control variates of the Linear(4, 3): layout order is sorted keys, "bias" (3) then "weight" (3 x 4)
C_SERVER = {"bias": torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64),
            "weight": torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)}
C_SITE = {"bias": torch.tensor([-0.25, 0.5, 1.0], dtype=torch.float64),
          "weight": torch.linspace(0.75, -0.5, 12, dtype=torch.float64).reshape(3, 4)}


def flat(controls: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([controls["bias"].numpy().ravel(), controls["weight"].numpy().ravel()]).astype(np.float32)


def received(linear: torch.nn.Module) -> dict[str, np.ndarray]:
    """A train task as the server sends it: the weights and c."""
    return {**{k: v.detach().numpy().copy() for k, v in linear.state_dict().items()}, SERVER_CONTROL: flat(C_SERVER)}


def ce_gradient(linear: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    linear.zero_grad()
    F.cross_entropy(linear(x), y).backward()
    return {name: param.grad.detach().clone() for name, param in linear.named_parameters()}


def trained(linear: torch.nn.Module, steps: int):
    """The site's trainer after one round of ``steps`` full-batch SGD steps, c_i = C_SITE, c = C_SERVER."""
    site = make_site()
    trainer = make_trainer(METHOD, linear, site, max_steps=steps, local_epochs=steps)
    trainer.control = {k: v.clone() for k, v in C_SITE.items()}
    trainer.receive(received(linear))
    meta = trainer.train_round(RoundContext(0, 1))
    return trainer, site, meta


def test_one_local_step_is_corrected_by_c_minus_c_i_and_c_i_plus_is_the_gradient_at_x(linear) -> None:
    """Algorithm 1, line 10: y ← y − η_l (g_i(y) − c_i + c); line 12 (option II) with K = 1 gives c_i⁺ = g_i(x)."""
    x0 = {k: v.detach().clone() for k, v in linear.named_parameters()}
    site = make_site()
    reference = torch.nn.Linear(4, 3).double()
    reference.load_state_dict(linear.state_dict())
    gradient = ce_gradient(reference, *site.train.tensors)

    trainer, _, meta = trained(linear, steps=1)

    for name, param in linear.named_parameters():
        expected = x0[name] - LR * (gradient[name] - C_SITE[name] + C_SERVER[name])
        torch.testing.assert_close(param.detach(), expected)
        torch.testing.assert_close(trainer.control[name], gradient[name])  # c_i − c + (x − y)/η_l = g(x)
    with torch.no_grad():
        loss_at_x = F.cross_entropy(reference(site.train.tensors[0]), site.train.tensors[1]).item()
    assert meta[contracts.TRAIN_LOSS] == pytest.approx(loss_at_x)


def test_after_k_steps_c_i_plus_is_c_i_minus_c_plus_the_step_over_k_lr(linear) -> None:
    """Algorithm 1, line 12 (option II): c_i⁺ = c_i − c + (x − y)/(K η_l), K = 3 full-batch steps, the y's replayed by
    hand; Δc_i = c_i⁺ − c_i is what the site sends (float32)."""
    site = make_site()
    reference = torch.nn.Linear(4, 3).double()
    reference.load_state_dict(linear.state_dict())
    x0 = {k: v.detach().clone() for k, v in reference.named_parameters()}
    for _ in range(3):
        gradient = ce_gradient(reference, *site.train.tensors)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param -= LR * (gradient[name] - C_SITE[name] + C_SERVER[name])

    trainer, _, _ = trained(linear, steps=3)

    expected = {name: C_SITE[name] - C_SERVER[name] + (x0[name] - param.detach()) / (3 * LR)
                for name, param in reference.named_parameters()}
    for name, param in linear.named_parameters():
        torch.testing.assert_close(param.detach(), dict(reference.named_parameters())[name].detach())
        torch.testing.assert_close(trainer.control[name], expected[name])
    sent = trainer.outgoing_arrays(RoundContext(0, 1))
    np.testing.assert_allclose(sent[DELTA_CONTROL], flat({k: expected[k] - C_SITE[k] for k in expected}), rtol=1e-6)


def test_c_i_stays_in_the_site_state_and_never_in_what_it_sends(linear) -> None:
    trainer, site, _ = trained(linear, steps=2)
    sent = trainer.outgoing_arrays(RoundContext(0, 1))
    own = flat(trainer.control)

    assert set(sent) == set(linear.state_dict()) | {DELTA_CONTROL}
    assert not any(np.allclose(np.ravel(value)[:own.size], own) for value in sent.values() if np.size(value) >= own.size)
    restarted = make_trainer(METHOD, torch.nn.Linear(4, 3).double(), site)
    restarted.load_state(trainer.state_dict())  # what the site runtime saves and restores
    for name, value in trainer.control.items():
        torch.testing.assert_close(restarted.control[name], value)


def test_a_control_variate_that_does_not_fit_the_model_is_refused(linear) -> None:
    trainer = make_trainer(METHOD, linear, make_site())
    with pytest.raises(PayloadError, match="15 finite floats"):
        trainer.receive({**received(linear), SERVER_CONTROL: np.zeros(14, np.float32)})
    with pytest.raises(PayloadError, match="finite"):
        trainer.receive({**received(linear), SERVER_CONTROL: np.full(15, np.nan, np.float32)})


def test_the_corrected_step_needs_plain_sgd(linear) -> None:
    """SCAFFOLD's local solver is SGD (Algorithm 1, line 10): momentum or Adam is refused, at the site too."""
    trainer = make_trainer(METHOD, linear, make_site())
    trainer.job_train_cfg = trainer.train_cfg = type(trainer.train_cfg)(optimizer="sgd", momentum=0.9)
    with pytest.raises(ConfigError, match="train.momentum=0.9"):
        trainer.train_round(RoundContext(0, 1))
    spec = get_method(METHOD)
    assert spec.train_defaults["optimizer"] == "sgd" and spec.train_defaults["momentum"] == 0.0
    resolve(RunConfig(method=METHOD, clients=2), "byoc")  # the defaults pass the pre-launch check
    for train, named in (({"momentum": 0.9}, "train.momentum=0.9"), ({"optimizer": "adam"}, "train.optimizer=adam")):
        with pytest.raises(ConfigError, match=f"needs plain SGD, but site-1 has {named}"):
            resolve(RunConfig(method=METHOD, clients=2, train=train), "byoc")  # refused before anything launches


def test_the_correction_reaches_every_trained_parameter_and_leaves_the_loss_unchanged(linear) -> None:
    """Gradient reach of the drift term: it adds exactly c − c_i to each parameter's gradient and 0 to the loss."""
    trainer = make_trainer(METHOD, linear, make_site())
    trainer.control = {k: v.clone() for k, v in C_SITE.items()}
    trainer.receive(received(linear))
    trainer.on_round_start(RoundContext(0, 1))
    x, y = make_site().train.tensors
    plain = ce_gradient(linear, x, y)
    linear.zero_grad()
    loss = trainer.compute_loss(x, y)
    loss.backward()

    torch.testing.assert_close(loss, F.cross_entropy(linear(x), y))
    for name, param in linear.named_parameters():
        torch.testing.assert_close(param.grad, plain[name] + C_SERVER[name] - C_SITE[name])


# ----- the server ---------------------------------------------------------------------------------------------------
GLOBAL = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}  # layout: b (3), then w (6)


def site_result(delta: list[float], n: int) -> tuple[dict[str, np.ndarray], dict]:
    arrays = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32),
              DELTA_CONTROL: np.asarray(delta, np.float32)}
    return arrays, {contracts.N_SAMPLES: n}


def server_round(core: RoundAggregation, round_index: int, results: dict) -> dict[str, np.ndarray]:
    """One round as the controller plays it: start, send (returns the task), accept every result, aggregate."""
    core.start_round(GLOBAL, RoundContext(round_index, 3))
    task = core.start_phase(contracts.TRAIN_PHASE)
    for site, result in results.items():
        assert core.accept(site, *result) is None
    core.aggregate()
    return task


def test_the_server_updates_c_by_the_bounded_shares_and_the_fraction_of_sites_that_answered() -> None:
    """Algorithm 1, line 17: c ← c + (|S|/N) avg Δc_i, the average under the job's bounded shares (robust.max_share
    0.6 caps site-3's 8/10 at 0.6, the others get 0.2 each); in round 2 site-2 is missing, so |S|/N = 2/3."""
    core = RoundAggregation(get_method(METHOD), {}, 3, 3, {"max_share": 0.6})
    d1, d2, d3 = np.arange(9.0), np.full(9, -2.0), np.linspace(1.0, 3.0, 9)
    first = server_round(core, 0, {"site-1": site_result(d1, 1), "site-2": site_result(d2, 1),
                                   "site-3": site_result(d3, 8)})
    np.testing.assert_array_equal(first[SERVER_CONTROL], np.zeros(9, np.float32))
    c1 = 0.2 * d1 + 0.2 * d2 + 0.6 * d3
    np.testing.assert_allclose(core.rule.control, c1, rtol=1e-6)

    second = server_round(core, 1, {"site-1": site_result(d2, 1), "site-3": site_result(d1, 8)})
    np.testing.assert_allclose(second[SERVER_CONTROL], c1.astype(np.float32))  # c travels with the next task
    c2 = c1 + 2 / 3 * (0.4 * d2 + 0.6 * d1)  # 1:8 capped at 0.6 -> 0.4 and 0.6
    np.testing.assert_allclose(core.rule.control, c2, rtol=1e-6)


def test_a_delta_c_of_the_wrong_size_or_beyond_its_bound_is_refused() -> None:
    core = RoundAggregation(get_method(METHOD), {}, 3, 3, {})
    core.start_round(GLOBAL, RoundContext(0, 3))
    core.start_phase(contracts.TRAIN_PHASE)
    assert "shape" in core.accept("site-1", *site_result([0.0] * 8, 1))
    assert "above" in core.accept("site-2", *site_result([1e5] * 9, 1))


def test_the_update_norm_bound_covers_delta_c() -> None:
    """Trust follows the new path: robust.max_norm_ratio compares the sites' Δc_i norms as it compares their model
    steps, so a site whose model step is honest but whose Δc_i is 1000 times the others' is refused with the reason."""
    core = RoundAggregation(get_method(METHOD), {}, 3, 3, {"max_norm_ratio": 10.0})
    core.start_round(GLOBAL, RoundContext(0, 3))
    core.start_phase(contracts.TRAIN_PHASE)
    for site, scale in (("site-1", 1.0), ("site-2", 2.0), ("site-3", 1000.0)):
        assert core.accept(site, *site_result(list(np.linspace(-scale, scale, 9)), 4)) is None
    core.aggregate()
    assert "the norm of 'scaffold_delta_c'" in core.rejected["site-3"]
    assert sorted(core.rule.sites_seen) == ["site-1", "site-2"]  # c moved by the two honest sites only


def test_a_job_resumed_from_its_round_checkpoint_corrects_with_the_c_it_had(tmp_path) -> None:
    """The server's c and its N sites are in the round checkpoint (never sent): the resumed job's next task carries
    the c of the crashed job, and its next update of c uses the same |S|/N, so c is what the crashed job's would
    be (a fresh rule would send c = 0 and count N from 0)."""
    from medflare.flare.resume_state import RULE_PREFIX, save_round_checkpoint
    from medflare.ops.checkpoint import load_checkpoint
    from tests.flare import test_controller_resume as resume_tests

    d1, d2 = np.arange(9.0), np.full(9, -2.0)
    crashed_core = RoundAggregation(get_method(METHOD), {}, 3, 3, {})
    server_round(crashed_core, 0, {"site-1": site_result(d1, 1), "site-2": site_result(d2, 3)})
    job_id, crashed = resume_tests.crashed_job(tmp_path)
    app = tmp_path / job_id / "app_server"
    save_round_checkpoint(str(app), crashed.results, GLOBAL, crashed._checkpoint_write, None, crashed_core.rule)
    crashed._checkpoint_write.wait()
    saved, _ = load_checkpoint(app / "medflare_checkpoint.npz")
    assert set(saved) == {"w", "b", RULE_PREFIX + SERVER_CONTROL}

    ctl, ctx = resume_tests.new_job(tmp_path, job_id)
    resumed_core = RoundAggregation(get_method(METHOD), {}, 3, 3, {})
    ctl.global_params, ctl.aggregator.core.rule = dict(GLOBAL), resumed_core.rule
    ctl._resume(ctx)
    assert set(ctl.global_params) == {"w", "b"}  # c stays out of the model the sites receive
    np.testing.assert_array_equal(resumed_core.rule.control, crashed_core.rule.control)
    task = server_round(resumed_core, 1, {"site-1": site_result(d2, 1)})
    np.testing.assert_allclose(task[SERVER_CONTROL], (0.25 * d1 + 0.75 * d2).astype(np.float32))
    server_round(crashed_core, 1, {"site-1": site_result(d2, 1)})
    np.testing.assert_allclose(resumed_core.rule.control, crashed_core.rule.control)  # |S|/N = 1/2 in both


def test_an_unusable_checkpointed_c_is_refused() -> None:
    rule = RoundAggregation(get_method(METHOD), {}, 3, 3, {}).rule
    with pytest.raises(ValueError, match="control variate"):
        rule.restore({"sites_seen": ["site-1"]}, {SERVER_CONTROL: np.array([1.0, np.nan])})
    with pytest.raises(ValueError, match="control variate"):
        rule.restore({}, {SERVER_CONTROL: np.zeros(3)})
