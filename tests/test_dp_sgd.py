"""DP-SGD at a site (medflare.dp_sgd): the accountant's ε, clipping and noise, the site's policy and budget, and ε
in the site's results and the run's summary and report."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medflare.console.report import build_summary, markdown_report
from medflare.dp_sgd import DPSGDConfig, PrivateTraining, SiteDPPolicy, epsilon_of, site_dp_settings
from medflare.errors import ConfigError, SiteDeclined
from medflare.methods.base import RoundContext
from medflare.plan import build_global_model, validated
from medflare.registry import get_method, list_methods
from medflare.run_config import RunConfig
from medflare.site_config import SITE_CONFIG_FILE, SiteSettings, TaskSpec, resolve_site_dp
from medflare.site_runtime import SiteRuntime

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

DELTA = 1e-5
SYNTHETIC = {"source": "synthetic:n=120,n_val=20,n_test=20,size=16,classes=3,channels=1", "partition": "iid",
             "num_sites": 1}  # 120 training images at the one site


# ----- the accountant ------------------------------------------------------------------------------------------
def test_epsilon_of_the_unsampled_gaussian_mechanism_matches_the_value_derived_by_hand() -> None:
    # q = 1 (every sample in every step), σ = 2, T = 10 steps. The Gaussian mechanism of sensitivity 1 and noise
    # σ is (α, α/(2σ²))-RDP at every order α (Mironov 2017, Prop. 7); T steps compose to
    # RDP(α) = Tα/(2σ²) = 1.25α.
    # RDP to (ε, δ) (Balle et al. 2020, Thm. 21): ε = RDP(α) + (log(1/δ) - log α)/(α - 1) + log((α - 1)/α).
    # Over the accountant's orders 1.1, 1.2, ..., 10.9, 12, ..., 63 the smallest is at α = 3.9:
    # 4.875 + (11.5129 - 1.3610)/2.9 + log(2.9/3.9) = 4.875 + 3.5006 - 0.2963 = 8.0794 (the continuous optimum
    # α - 1 = sqrt(11.51/1.25) ≈ 3.03 gives about the same, 8.09).
    by_hand = 1.25 * 3.9 + (math.log(1 / DELTA) - math.log(3.9)) / 2.9 + math.log(2.9 / 3.9)
    assert by_hand == pytest.approx(8.0794, abs=1e-4)
    assert epsilon_of([(2.0, 1.0, 10)], DELTA) == pytest.approx(by_hand, abs=1e-6)
    # rounds compose: two rounds of 5 steps spend what one round of 10 does; sampling spends far less
    assert epsilon_of([(2.0, 1.0, 5), (2.0, 1.0, 5)], DELTA) == pytest.approx(by_hand, abs=1e-6)
    assert epsilon_of([(2.0, 0.01, 10)], DELTA) < by_hand / 10
    assert epsilon_of([], DELTA) == 0.0


# ----- clipping and noise ---------------------------------------------------------------------------------------
def one_step_update(noise_multiplier: float, seed: int, batch: int = 8, clip: float = 0.01) -> torch.Tensor:
    """The parameter change of one DP-SGD step (SGD, lr 1) of a linear model on one fixed batch of ``batch``
    samples, with ``batch`` also the expected batch size (sample rate batch / N)."""
    torch.manual_seed(0)
    model = nn.Linear(50, 10)
    cfg = DPSGDConfig(noise_multiplier=noise_multiplier, max_grad_norm=clip)
    dp = PrivateTraining(cfg, model, num_samples=10 * batch)
    optimizer = dp.wrap(torch.optim.SGD(model.parameters(), lr=1.0), batch_size=batch)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    images, labels = 100 * torch.randn(batch, 50), torch.randint(0, 10, (batch,))  # gradients far above the clip
    torch.manual_seed(seed)  # the noise's draw
    optimizer.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def test_each_sample_is_clipped_and_the_noise_has_the_configured_scale() -> None:
    clip, batch = 0.01, 8
    torch.manual_seed(0)
    plain = nn.Linear(50, 10)
    F.cross_entropy(plain(100 * torch.randn(batch, 50)), torch.randint(0, 10, (batch,))).backward()
    assert torch.cat([p.grad.flatten() for p in plain.parameters()]).norm() > 100 * clip  # clipping has work to do
    clipped = one_step_update(1e-9, seed=1)
    assert 0 < clipped.norm() <= clip * (1 + 1e-6)  # the mean of clipped gradients: at most C
    noisy, other_draw = one_step_update(1.0, seed=1), one_step_update(1.0, seed=2)
    assert not torch.equal(noisy, other_draw)  # same data, same model: only the noise differs
    noise = noisy - clipped  # N(0, (σC)²) per coordinate, divided by the expected batch size
    assert noise.std().item() == pytest.approx(1.0 * clip / batch, rel=0.15)


def test_a_step_is_the_sum_of_clipped_per_sample_gradients_over_the_expected_batch() -> None:
    # The trainer's loss is a mean over the batch's rows; Opacus undoes it per sample, clips, sums and divides by
    # the *expected* batch (a Poisson batch of 6 where 8 are expected): a wrong reduction scales every step.
    torch.manual_seed(0)
    model, clip, rows, expected = nn.Linear(5, 3), 2.0, 6, 8
    scales = torch.tensor([0.1, 0.3, 1.0, 3.0, 10.0, 30.0])[:, None]  # small gradients kept, large ones clipped
    images, labels = torch.randn(rows, 5) * scales, torch.arange(rows) % 3
    by_hand = []
    for image, label in zip(images, labels):  # each sample's own gradient, clipped to C
        model.zero_grad()
        F.cross_entropy(model(image[None]), label[None]).backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        by_hand.append(grad * min(1.0, clip / grad.norm().item()))
    assert min(g.norm() for g in by_hand) < clip * 0.99 and max(g.norm() for g in by_hand) == pytest.approx(clip)
    dp = PrivateTraining(DPSGDConfig(noise_multiplier=1e-9, max_grad_norm=clip), model, num_samples=10 * expected)
    optimizer = dp.wrap(torch.optim.SGD(model.parameters(), lr=1.0), batch_size=expected)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer.zero_grad()
    (F.cross_entropy(model(images), labels, reduction="sum") / rows).backward()  # the trainer's supervised loss
    optimizer.step()
    update = before - torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(update, torch.stack(by_hand).sum(0) / expected, atol=1e-6)


def test_an_adam_type_optimizer_is_kept_with_a_one_line_warning_and_sgd_without() -> None:
    model = nn.Linear(4, 2)
    dp = PrivateTraining(DPSGDConfig(), model, num_samples=40)
    with pytest.warns(UserWarning, match=r"train.optimizer=adam: .*train.optimizer=sgd"):
        wrapped = dp.wrap(torch.optim.Adam(model.parameters()), batch_size=10)
    assert isinstance(wrapped.original_optimizer, torch.optim.Adam)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.wrap(torch.optim.SGD(model.parameters(), lr=0.1), batch_size=10)


def test_the_accountant_counts_every_step_and_survives_a_restart() -> None:
    model = nn.Linear(4, 2)
    dp = PrivateTraining(DPSGDConfig(noise_multiplier=1.0), model, num_samples=40)
    optimizer = dp.wrap(torch.optim.SGD(model.parameters(), lr=0.1), batch_size=10)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(10, 4)), torch.randint(0, 2, (10,))).backward()
        optimizer.step()
    assert dp.epsilon() == pytest.approx(epsilon_of([(1.0, 0.25, 3)], DELTA))
    restarted = PrivateTraining(DPSGDConfig(noise_multiplier=1.0), nn.Linear(4, 2), num_samples=40)
    restarted.load_state_dict(dp.state_dict())
    assert restarted.epsilon() == dp.epsilon()
    with pytest.raises(ConfigError, match="accountant 'rdp'"):
        PrivateTraining(DPSGDConfig(accountant="prv"), nn.Linear(4, 2), 40).load_state_dict(dp.state_dict())


# ----- the model every party builds -----------------------------------------------------------------------------
def test_server_and_site_build_the_same_dp_compatible_architecture(tmp_path: Path) -> None:
    server = build_global_model("fedavg", "cnn", 3, 1, 16, dp_sgd=True).state_dict()
    site = SiteRuntime(site_settings(DPSGDConfig(noise_multiplier=1.0)), "site-1", 0, log=lambda _: None)
    assert {k: v.shape for k, v in server.items()} == {k: v.shape for k, v in site.model.state_dict().items()}
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in site.model.modules())
    assert any(k.endswith("running_mean") for k in build_global_model("fedavg", "cnn", 3, 1, 16).state_dict())


# ----- methods --------------------------------------------------------------------------------------------------
BLOCKED = [name for name in list_methods() if get_method(name).dp_sgd_blocker]


def test_methods_declare_whether_their_update_can_be_dp() -> None:
    assert {"fedprox", "fedlsm", "mdhfl", "fedmd", "fedrep", "fed-mae", "fed-beit"} <= set(BLOCKED)
    assert not get_method("fedavg").dp_sgd_blocker


@pytest.mark.parametrize("method", BLOCKED)
def test_a_method_whose_update_cannot_be_dp_is_refused_with_its_reason(method: str) -> None:
    run = RunConfig(method=method, dp_sgd={"noise_multiplier": 1.0}, data={"source": "synthetic:n=60"})
    with pytest.raises(ConfigError, match=f"method '{method}' cannot train with DP-SGD: "):
        run = validated(run, check_files=False)


def test_the_run_config_writes_out_every_dp_setting() -> None:
    run = RunConfig(method="fedavg", dp_sgd={"noise_multiplier": "1.5"}, data={"source": "synthetic:n=60"})
    run = validated(run, check_files=False)
    assert run.dp_sgd == {"noise_multiplier": 1.5, "max_grad_norm": 1.0, "delta": DELTA, "max_epsilon": 0.0,
                          "accountant": "rdp"}
    with pytest.raises(ConfigError, match=r"dp_sgd.delta must be between 0 \(excluded\) and 1 \(excluded\), got 2"):
        validated(RunConfig(method="fedavg", dp_sgd={"delta": 2}), check_files=False)


# ----- the site's policy and budget ------------------------------------------------------------------------------
POLICY = {"required": True, "max_epsilon": 8, "min_noise_multiplier": 1.0, "max_grad_norm": 1.0, "max_delta": 1e-5}
REFUSED_JOBS = [
    ({}, "requires DP-SGD and the job has none"),
    ({"noise_multiplier": 0.5}, "noise_multiplier 0.5 is below its floor 1"),
    ({"noise_multiplier": 1.2, "max_grad_norm": 5.0}, "max_grad_norm 5 is above its ceiling 1"),
    ({"noise_multiplier": 1.2, "delta": 1e-3}, "delta 0.001 is above its max_delta 1e-05"),
    ({"noise_multiplier": 1.2, "max_epsilon": 10}, "max_epsilon 10 is above its budget 8"),
]


@pytest.mark.parametrize("job, reason", REFUSED_JOBS, ids=[reason.split(" ")[0] for _, reason in REFUSED_JOBS])
def test_a_site_declines_a_job_that_asks_for_less_than_its_policy(tmp_path: Path, job: dict, reason: str) -> None:
    (tmp_path / SITE_CONFIG_FILE).write_text(json.dumps({"data": {"source": "folder:/x"}, "dp_sgd": POLICY}))
    with pytest.raises(SiteDeclined, match=f"site-1 declines the job.*{reason}"):
        resolve_site_dp(DPSGDConfig(**job) if job else None, "site-1", tmp_path)


@pytest.mark.parametrize("bound", [{"max_epsilon": 8}, {"min_noise_multiplier": 1.0}, {"max_grad_norm": 1.0}])
def test_a_site_with_a_dp_bound_but_without_required_declines_a_job_without_dp_sgd(tmp_path: Path,
                                                                                    bound: dict) -> None:
    """A floor, ceiling or budget used to bind only jobs that had a dp_sgd section: a job without one trained with
    no noise at all (unbounded ε) unless the site also wrote "required": true (issue 49, item 5)."""
    (tmp_path / SITE_CONFIG_FILE).write_text(json.dumps({"data": {"source": "folder:/x"}, "dp_sgd": bound}))
    with pytest.raises(SiteDeclined, match=f"site-1 declines the job: .*dp_sgd \\({next(iter(bound))}\\) requires"):
        resolve_site_dp(None, "site-1", tmp_path)
    assert resolve_site_dp(DPSGDConfig(noise_multiplier=1.2), "site-1", tmp_path).noise_multiplier == 1.2


def test_a_site_takes_the_lower_budget_and_a_site_without_policy_takes_the_job(tmp_path: Path) -> None:
    rules = SiteDPPolicy(**POLICY)
    assert site_dp_settings(DPSGDConfig(noise_multiplier=1.2), rules, "site-1").max_epsilon == 8
    assert site_dp_settings(DPSGDConfig(noise_multiplier=1.2, max_epsilon=3), rules, "site-1").max_epsilon == 3
    assert resolve_site_dp(DPSGDConfig(noise_multiplier=1.2), "site-1", tmp_path).noise_multiplier == 1.2  # no file
    assert resolve_site_dp(None, "site-1", tmp_path) is None


def site_settings(dp_sgd: DPSGDConfig) -> SiteSettings:
    return SiteSettings(spec=get_method("fedavg"), task=TaskSpec(num_classes=3, in_channels=1, image_size=16), data=SYNTHETIC,
                        train={"batch_size": 16, "max_steps": 3}, dp_sgd=dp_sgd, evaluation="off")


def test_a_site_stops_at_its_budget_and_a_restarted_site_remembers_what_it_spent(tmp_path: Path) -> None:
    one_round = epsilon_of([(1.0, 16 / 120, 3)], DELTA)  # 3 steps at q = 16/120: about 3.07
    two_rounds = epsilon_of([(1.0, 16 / 120, 6)], DELTA)  # about 3.66
    budget = (one_round + two_rounds) / 2
    settings = site_settings(DPSGDConfig(noise_multiplier=1.0, max_epsilon=budget))
    site = SiteRuntime(settings, "site-1", 0, log=lambda _: None, local_dir=tmp_path)
    _, meta = site.train(site.shared_weights(), RoundContext(0, 3))
    assert meta["dp_epsilon"] == pytest.approx(one_round)
    with pytest.raises(SiteDeclined, match=r"budget spent: ε = 3\.07\d .*would reach 3\.66\d > max_epsilon"):
        site.train(site.shared_weights(), RoundContext(1, 3))
    site.close()
    restarted = SiteRuntime(settings, "site-1", 0, log=lambda _: None, local_dir=tmp_path)
    assert restarted.trainer.dp.epsilon() == pytest.approx(one_round)  # the accountant came back with the state
    with pytest.raises(SiteDeclined, match="this site stops contributing"):
        restarted.train(restarted.shared_weights(), RoundContext(1, 3))


def dataclass_dict(**settings: float) -> dict:
    return vars(DPSGDConfig(**settings))


# ----- ε in the run's records ------------------------------------------------------------------------------------
def test_epsilon_reaches_the_summary_and_the_report_per_site() -> None:
    declined = "EXECUTION_EXCEPTION: DP-SGD budget spent: ε = 5.876 ...; this site stops contributing"
    rounds = [
        {"round": 0, "started_at": 0.0, "wall_seconds": 1.0, "failed": {}, "rejected": {},
         "sites": {"site-1": {"n_samples": 120, "dp_epsilon": 3.07}, "site-2": {"n_samples": 120, "dp_epsilon": 4.59}}},
        {"round": 1, "started_at": 1.0, "wall_seconds": 1.0, "failed": {"site-2": declined}, "rejected": {},
         "sites": {"site-1": {"n_samples": 120, "dp_epsilon": 3.66}}},
    ]
    config = {"method": "fedavg", "dp_sgd": {"delta": DELTA}, "task": {"num_classes": 3}}
    summary = build_summary({"method": "fedavg", "rounds": rounds}, config, {"site-1": {}, "site-2": {}})
    assert summary["clients"]["site-1"]["dp_epsilon"] == [3.07, 3.66]
    assert summary["clients"]["site-2"]["dp_epsilon"] == [4.59]
    assert [entry["dp_epsilon"] for entry in summary["per_round"]] == [{"site-1": 3.07, "site-2": 4.59},
                                                                       {"site-1": 3.66}]
    assert summary["per_round"][1]["failed"]["site-2"] == declined
    report = markdown_report(summary)
    assert "ε spent (DP-SGD, δ = 1e-05)" in report and "| site-1 | 120 | - | 3.660 after 2 round(s) |" in report
