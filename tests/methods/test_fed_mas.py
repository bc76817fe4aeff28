"""Fed-MAS: rescue factor, aggregation rule, frozen prior and what leaves the site."""

from pathlib import Path

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import from_shareable
from nvflare.apis.signal import Signal

from medflare.errors import ConfigError
from medflare.flare.executor import MedflareExecutor
from medflare.methods.base import RoundContext
from medflare.methods.fed_mas import FedMasConfig
from medflare.methods.fed_mas.prior import IMAGENET_MEAN, IMAGENET_STD, MOCO_PREFIX, build_prior
from medflare.methods.fed_mas.rescue import ClassMeanAccumulator, distillation_distance, rescue_factor
from medflare.ops import cap_shares
from medflare.registry import get_method
from medflare.server_round import RoundAggregation
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

# ----- rescue factor, by hand -------------------------------------------------------------------------


def test_rescue_factor_two_classes_by_hand() -> None:
    # w̄ = [0.25, 0.75], ŵ̄ = [0.25, 0.75] -> RF = 0.25² + 0.75² = 0.625
    assert rescue_factor(np.array([0.2, 0.6]), np.array([1.0, 3.0])) == pytest.approx(0.625)


def test_rescue_factor_skips_absent_classes_and_inverts_for_mas_inv() -> None:
    w, w_hat = np.array([0.2, 0.0, 0.6]), np.array([1.0, 0.0, 3.0])
    assert rescue_factor(w, w_hat) == pytest.approx(0.625)
    # mas_inv: ŵ -> [1, 0, 1/3] -> ŵ̄ = [0.75, 0, 0.25] -> RF = 0.25*0.75 + 0.75*0.25
    assert rescue_factor(w, w_hat, invert=True) == pytest.approx(0.375)
    assert rescue_factor(np.array([0.0, 0.7]), np.array([0.0, 5.0])) == pytest.approx(1.0)  # one-class site


def test_mas_inv_inverts_the_training_distances_not_the_global_ones() -> None:
    # w̄ = [0.6, 0.3, 0.1]; 1/ŵ = [1, 1, 1/8] -> [8/17, 8/17, 1/17]; RF = (4.8 + 2.4 + 0.1) / 17
    # (inverting w instead would give 1/w̄ -> [1/9, 2/9, 6/9] with ŵ̄ = [0.1, 0.1, 0.8]: RF = 5.1 / 9)
    rf = rescue_factor(np.array([0.6, 0.3, 0.1]), np.array([1.0, 1.0, 8.0]), invert=True)
    assert rf == pytest.approx(7.3 / 17)


def test_class_mean_accumulator_divides_by_full_class_counts() -> None:
    acc = ClassMeanAccumulator(3)
    acc.add(torch.tensor([0, 0, 1, -1]), torch.tensor([1.0, 3.0, 2.0, 100.0]))  # the unlabelled sample is skipped
    np.testing.assert_allclose(acc.per_class(np.array([2, 1, 0])), [2.0, 2.0, 0.0])


def test_distillation_distance_range() -> None:
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    torch.testing.assert_close(distillation_distance(x, y), torch.tensor([0.0, 2.0, 4.0]))


# ----- server rule ------------------------------------------------------------------------------------

GLOBAL = {"w": np.zeros(2, np.float32)}


def fedmas_round(**method_args) -> RoundAggregation:
    core = RoundAggregation(get_method("fedmas"), method_args, num_classes=2, num_rounds=10)
    core.start_round(GLOBAL, RoundContext(0, 10))
    core.start_phase("train")
    return core


def test_aggregation_is_rf_weighted() -> None:
    core = fedmas_round()
    core.accept("a", {"w": np.array([1.0, 0.0], np.float32)}, {"n_samples": 1000, "rf": 0.2})
    core.accept("b", {"w": np.array([0.0, 1.0], np.float32)}, {"n_samples": 10, "rf": 0.6})
    result = core.aggregate()
    np.testing.assert_allclose(result.params["w"], [0.25, 0.75])  # RF̄ = 0.2/0.8, 0.6/0.8; sample counts ignored
    assert result.shares == pytest.approx({"a": 0.25, "b": 0.75})
    assert result.info == {"rf": {"a": 0.2, "b": 0.6}}


@pytest.mark.parametrize("rf", [float("nan"), float("inf"), -0.3, 0.0, 1.5, "0.5", None])
def test_bad_rf_is_excluded(rf) -> None:
    core = fedmas_round()
    meta = {"n_samples": 5} if rf is None else {"n_samples": 5, "rf": rf}
    assert "rf" in core.accept("bad", {"w": np.ones(2, np.float32)}, meta)  # refused, and the reason names the RF
    assert core.accept("good", {"w": np.zeros(2, np.float32)}, {"n_samples": 5, "rf": 0.5}) is None
    assert core.aggregate().shares == {"good": 1.0}


def test_bsm_kd_weighs_sites_by_sample_count_without_any_rf() -> None:
    core = RoundAggregation(get_method("bsm-kd"), {}, num_classes=2, num_rounds=10)
    core.start_round(GLOBAL, RoundContext(0, 10))
    core.start_phase("train")
    assert core.accept("a", {"w": np.array([1.0, 0.0], np.float32)}, {"n_samples": 30}) is None
    assert core.accept("b", {"w": np.array([0.0, 1.0], np.float32)}, {"n_samples": 10}) is None
    result = core.aggregate()
    assert result.shares == pytest.approx({"a": 0.75, "b": 0.25})
    np.testing.assert_allclose(result.params["w"], [0.75, 0.25])


def mas_drw_share_of_a(round_index: int, total_rounds: int, stream: bool = False, **method_args) -> float:
    """Site a's share under mas_drw; a: n = 30, RF = 0.5; b: n = 10, RF = 0.25."""
    core = RoundAggregation(get_method("fedmas"), {"aggregation": "mas_drw", **method_args}, num_classes=2, num_rounds=total_rounds,
                            stream_aggregation=stream)
    core.start_round(GLOBAL, RoundContext(round_index, total_rounds))
    core.start_phase("train")
    core.accept("a", {"w": np.zeros(2, np.float32)}, {"n_samples": 30, "rf": 0.5})
    core.accept("b", {"w": np.zeros(2, np.float32)}, {"n_samples": 10, "rf": 0.25})
    return core.aggregate().shares["a"]


# The authors' rule, by hand. 1/RF = 2 and 4, normalised: ñ_a = 1/3, ñ_b = 2/3.
# β = 0.5: 0.5^(1/3) = 0.7937005, 0.5^(2/3) = 0.6299605, so (1 − β)/(1 − β^ñ) = 2.4236611 and 1.3512072;
# times n: 72.709832 and 13.512072, so a's share is 72.709832 / 86.221904 = 0.8432872.
HAND_SHARE_BETA_HALF = 0.8432872
# β = 0.9999: (1 − β)/(1 − β^ñ) ≈ 1/ñ (3 and 1.5), so the weights approach n·RF (15 and 2.5) and a's share 6/7.
HAND_SHARE_DEFAULT_BETA = 6 / 7


@pytest.mark.parametrize(
    ("total_rounds", "last_sample_round"),
    [(10, 7), (200, 159), (7, 4)],  # switch at ⌊0.8 R⌋ = 8, 160, 5 (the authors' int(0.8 · comm_round))
)
def test_mas_drw_uses_sample_counts_until_the_switch_round(total_rounds: int, last_sample_round: int) -> None:
    assert mas_drw_share_of_a(last_sample_round, total_rounds) == pytest.approx(0.75)  # 30 / (30 + 10)
    switched = mas_drw_share_of_a(last_sample_round + 1, total_rounds)
    assert switched == pytest.approx(HAND_SHARE_DEFAULT_BETA, abs=1e-5)
    assert switched != pytest.approx(0.75)


def test_mas_drw_weights_are_sample_counts_times_effective_number_of_normalised_inverse_rf() -> None:
    assert mas_drw_share_of_a(9, 10, drw_beta=0.5) == pytest.approx(HAND_SHARE_BETA_HALF, abs=1e-7)
    assert mas_drw_share_of_a(0, 10, drw_beta=0.5, drw_start=0.0) == pytest.approx(HAND_SHARE_BETA_HALF, abs=1e-7)


def test_mas_drw_switch_round_is_not_lost_to_float_rounding() -> None:
    # 0.29 · 100 = 28.999999999999996 in floats; ⌊0.29 · 100⌋ = 29 is the first re-weighted round.
    assert mas_drw_share_of_a(28, 100, drw_start=0.29) == pytest.approx(0.75)
    assert mas_drw_share_of_a(29, 100, drw_start=0.29) == pytest.approx(HAND_SHARE_DEFAULT_BETA, abs=1e-5)


def test_mas_drw_shares_hold_when_the_job_streams_its_aggregation() -> None:
    """DRW factors need every site's RF at once: a streaming job must still apply them (it aggregates in one batch)."""
    assert mas_drw_share_of_a(9, 10, stream=True, drw_beta=0.5) == pytest.approx(HAND_SHARE_BETA_HALF, abs=1e-7)


@pytest.mark.parametrize("bad", [{"drw_beta": 1.0}, {"drw_beta": -0.1}, {"drw_start": 1.5}])
def test_mas_drw_options_are_range_checked(bad: dict) -> None:
    with pytest.raises(ConfigError):
        FedMasConfig(**bad)


def test_an_impossible_cap_relaxes_instead_of_stopping_the_round() -> None:
    """max_share=0.3 with one of four sites rejected: 3 x 0.3 < 1, so every remaining site gets 1/3."""
    assert cap_shares({"a": 0.8, "b": 0.1, "c": 0.1}, 0.3) == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})


def test_cap_shares_redistributes_the_excess() -> None:
    capped = cap_shares({"a": 0.7, "b": 0.2, "c": 0.1}, 0.5)
    assert capped == pytest.approx({"a": 0.5, "b": 0.2 + 0.2 * 2 / 3, "c": 0.1 + 0.2 / 3})
    assert cap_shares({"a": 0.7, "b": 0.3}, 0.0) == {"a": 0.7, "b": 0.3}


# ----- site side: the global divergence w, by hand ---------------------------------------------------

# Six 1x2x2 "images", classes 0, 0, 0, 2, 2, 2: class 1 is absent, so its w must stay 0.
W_LABELS = torch.tensor([0, 0, 0, 2, 2, 2])
W_IMAGES = torch.linspace(-1, 1, 24).reshape(6, 1, 2, 2) * torch.tensor([1.0, -0.5, 0.8, -1.0]).reshape(1, 1, 2, 2)


def tiny_fedmas_trainer(tmp_path: Path, method: str = "fedmas", **method_args):
    """FedMasTrainer on a Flatten-Linear-Tanh backbone whose projector has BatchNorm, with a linear prior.

    The prior is a TorchScript file (as a site would ship one), so it goes through the real prior loader.
    ``method`` is fedmas or bsm-kd (same site training); ``method_args`` go to its config.
    """
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from medflare.methods.fed_mas.model import FedMasNet
    from medflare.models import Classifier

    from ._trainers import make_trainer

    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))  # [B, 3, 2, 2] -> [B, 3]
    torch.jit.script(encoder).save(str(tmp_path / "prior.pt"))
    model = FedMasNet(Classifier(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 5), torch.nn.Tanh()),
                                 torch.nn.Linear(5, 3)), prior_dim=3, hidden_dim=6)
    dataset = TensorDataset(W_IMAGES, W_LABELS)
    site = SimpleNamespace(train=dataset, val=dataset, test=dataset, num_classes=3, class_counts=np.array([3, 0, 3]))
    cfg = get_method(method).config_cls(prior=f"torchscript:{tmp_path / 'prior.pt'}", prior_dim=3, prior_input_size=2,
                                        **method_args)
    trainer = make_trainer(method, model, site, cfg, local_epochs=3)
    return trainer, encoder


def received_global_model(trainer) -> dict[str, np.ndarray]:
    """A global model whose BatchNorm running statistics are far from this site's batch statistics."""
    rng = np.random.default_rng(1)
    state = {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}
    state["projector.1.running_mean"] = rng.normal(0.0, 1.0, 6).astype(np.float32)
    state["projector.1.running_var"] = rng.uniform(0.2, 3.0, 6).astype(np.float32)
    state["projector.1.weight"] = rng.uniform(0.5, 2.0, 6).astype(np.float32)
    state["projector.1.bias"] = rng.normal(0.0, 0.5, 6).astype(np.float32)
    return state


def hand_global_divergence(params: dict[str, np.ndarray], encoder: torch.nn.Module) -> np.ndarray:
    """w_k = mean over class k of 2 − 2·cos(projector(backbone(x)), prior(x)), BatchNorm on running statistics."""
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    x = W_IMAGES.numpy().astype(np.float64)
    features = np.tanh(x.reshape(6, 4) @ p["backbone.1.weight"].T + p["backbone.1.bias"])
    hidden = features @ p["projector.0.weight"].T + p["projector.0.bias"]
    hidden = (hidden - p["projector.1.running_mean"]) / np.sqrt(p["projector.1.running_var"] + 1e-5)
    hidden = np.maximum(hidden * p["projector.1.weight"] + p["projector.1.bias"], 0.0)
    student = hidden @ p["projector.3.weight"].T + p["projector.3.bias"]
    pixels = np.repeat(x * 0.5 + 0.5, 3, axis=1)  # grey -> RGB, back to [0, 1]
    pixels = (pixels - np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1)) / np.array(IMAGENET_STD).reshape(1, 3, 1, 1)
    linear = encoder[1]
    teacher = pixels.reshape(6, 12) @ linear.weight.detach().double().numpy().T + linear.bias.detach().double().numpy()
    cosine = (student * teacher).sum(1) / (np.linalg.norm(student, axis=1) * np.linalg.norm(teacher, axis=1))
    distance = 2 - 2 * cosine
    labels = W_LABELS.numpy()
    return np.array([distance[labels == k].mean() if (labels == k).any() else 0.0 for k in range(3)])


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # TorchScript priors are supported
def test_w_is_the_received_model_in_eval_mode_and_leaves_batchnorm_statistics_alone(tmp_path: Path) -> None:
    # Prepare
    trainer, encoder = tiny_fedmas_trainer(tmp_path)
    received = received_global_model(trainer)
    trainer.receive(received)
    trainer.model.train()  # as after a previous round's training
    # Execute
    w = trainer.global_divergence()
    # Assert
    np.testing.assert_allclose(w, hand_global_divergence(received, encoder), rtol=1e-5, atol=1e-7)
    assert w[1] == 0.0 and w[0] > 0 and w[2] > 0
    for key in ("projector.1.running_mean", "projector.1.running_var", "projector.1.num_batches_tracked"):
        np.testing.assert_array_equal(trainer.model.state_dict()[key].numpy(), received[key], err_msg=key)


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # TorchScript priors are supported
def test_w_of_a_round_comes_from_the_received_weights_not_the_trained_ones(tmp_path: Path) -> None:
    # Prepare
    trainer, encoder = tiny_fedmas_trainer(tmp_path)
    received = received_global_model(trainer)
    trainer.receive(received)
    # Execute
    meta = trainer.train_round(RoundContext(0, 2))
    # Assert
    trained = {k: v.detach().numpy() for k, v in trainer.model.state_dict().items()}
    assert not np.allclose(trained["projector.0.weight"], received["projector.0.weight"])  # training moved it
    assert not np.allclose(hand_global_divergence(trained, encoder), hand_global_divergence(received, encoder))
    np.testing.assert_allclose(trainer.w, hand_global_divergence(received, encoder), rtol=1e-5, atol=1e-7)
    assert 0 < meta["rf"] <= 1


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # TorchScript priors are supported
@pytest.mark.parametrize(("method", "lambda_f", "aux_head_weight"),
                         [("fedmas", 3.0, 1.0), ("fedmas", 1.0, 0.5), ("bsm-kd", 3.0, 1.0)])
def test_site_loss_is_bsm_on_both_heads_plus_lambda_f_times_the_mean_distance(
    tmp_path: Path, method: str, lambda_f: float, aux_head_weight: float
) -> None:
    # Prepare: classes 0 and 2 only (3 each), so BSM shifts by log(1/2, 1e-12, 1/2)
    trainer, encoder = tiny_fedmas_trainer(tmp_path, method, lambda_f=lambda_f, aux_head_weight=aux_head_weight)
    trainer.model.train()
    logits, aux_logits, projected = (t.detach().double() for t in trainer.model.forward_train(W_IMAGES))
    pixels = (W_IMAGES.double().repeat(1, 3, 1, 1) * 0.5 + 0.5 - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
    teacher = encoder.double()(pixels / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)).detach()
    distance = 2 - 2 * torch.nn.functional.cosine_similarity(projected, teacher, dim=1)
    shift = torch.log(torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64) + 1e-12)
    bsm = torch.nn.functional.cross_entropy(logits + shift, W_LABELS)
    aux_bsm = torch.nn.functional.cross_entropy(aux_logits + shift, W_LABELS)
    # Execute
    loss = trainer.compute_loss(W_IMAGES, W_LABELS)
    # Assert
    expected = bsm + aux_head_weight * aux_bsm + lambda_f * distance.mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # TorchScript priors are supported
def test_a_mas_inv_site_sends_the_rf_of_its_inverted_training_distances(tmp_path: Path) -> None:
    # Prepare
    trainer, _ = tiny_fedmas_trainer(tmp_path, aggregation="mas_inv")
    trainer.receive(received_global_model(trainer))
    # Execute
    rf = trainer.train_round(RoundContext(0, 2))["rf"]
    # Assert: RF = Σ w̄_k · (1/ŵ_k) / Σ_j (1/ŵ_j) over the site's classes 0 and 2
    w, w_hat = trainer.w[[0, 2]], trainer.w_hat.per_class(np.array([3, 0, 3]))[[0, 2]]
    inverse = 1 / w_hat
    assert rf == pytest.approx(float(np.sum(w / w.sum() * inverse / inverse.sum())), rel=1e-9)
    assert rf != pytest.approx(float(np.sum(w / w.sum() * w_hat / w_hat.sum())), rel=1e-3)  # the case tells them apart


# ----- site side: frozen prior and payload ------------------------------------------------------------

SITE_OPTIONS = dict(
    spec=get_method("fedmas"),
    task=TaskSpec(num_classes=5, in_channels=3, image_size=28),
    data={"source": "synthetic:n=300", "partition": "iid", "num_sites": 2},
    method_args={"prior_input_size": 32},
    train={"max_steps": 2, "batch_size": 32},
)
SETTINGS = SiteSettings(**SITE_OPTIONS)


@pytest.fixture(scope="module")
def runtime() -> SiteRuntime:
    return SiteRuntime(SETTINGS, "site-1", 0, log=lambda m: None)


def prior_state(runtime: SiteRuntime) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in runtime.trainer.prior.state_dict().items()}


def test_prior_weights_and_bn_buffers_are_bit_identical_after_a_round(runtime: SiteRuntime) -> None:
    before = prior_state(runtime)
    assert any("running_mean" in k for k in before)
    runtime.train(runtime.shared_weights(), RoundContext(0, 2))
    after = prior_state(runtime)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not runtime.trainer.prior.training and not any(p.requires_grad for p in runtime.trainer.prior.parameters())


def test_repo_compat_flag_reproduces_the_teacher_bn_drift() -> None:
    settings = SiteSettings(**{**SITE_OPTIONS, "method_args": {"prior_input_size": 32, "repo_compat_teacher_bn": True}})
    runtime = SiteRuntime(settings, "site-1", 0, log=lambda m: None)
    before = prior_state(runtime)
    runtime.train(runtime.shared_weights(), RoundContext(0, 2))
    after = prior_state(runtime)
    assert any(not torch.equal(before[k], after[k]) for k in before if "running_mean" in k)


def test_outgoing_shareable_carries_weights_and_rf_only(runtime: SiteRuntime) -> None:
    from nvflare.apis.dxo import DXO, DataKind

    task = DXO(DataKind.WEIGHTS, data=runtime.shared_weights(), meta={"round": 0, "total_rounds": 2}).to_shareable()
    result = MedflareExecutor()._dispatch(runtime, "train", task, Signal())
    dxo = from_shareable(result)
    assert set(dxo.data) == set(runtime.model.state_dict())  # the model's own keys: no prior, no w, no ŵ
    assert not any(k.startswith(("prior", "encoder")) for k in dxo.data)
    assert set(dxo.meta) == {"rf", "n_samples", "train_loss", "train_seconds", "eval_val", "eval_test", "eval_test_by_attribute"}
    assert 0 < dxo.meta["rf"] <= 1
    prior_keys = set(runtime.trainer.prior.state_dict())
    assert not prior_keys & set(dxo.data)


def test_bsm_kd_sends_no_rf() -> None:
    settings = SiteSettings(**{**SITE_OPTIONS, "spec": get_method("bsm-kd")})
    _, meta = SiteRuntime(settings, "site-1", 0, log=lambda m: None).train({}, RoundContext(0, 1))
    assert "rf" not in meta


def test_moco_checkpoint_layout_loads(tmp_path: Path) -> None:
    import torchvision

    network = torchvision.models.resnet50(weights=None)
    network.fc = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 128))
    state = {f"{MOCO_PREFIX}{k}": v for k, v in network.state_dict().items()}
    state["module.encoder_k.conv1.weight"] = torch.zeros(1)  # the key encoder is ignored
    torch.save({"state_dict": state, "epoch": 800}, tmp_path / "moco.pth.tar")
    prior = build_prior(f"moco:{tmp_path / 'moco.pth.tar'}", 0, input_size=32)
    assert prior(torch.zeros(2, 1, 28, 28)).shape == (2, 2048)
    torch.testing.assert_close(prior.encoder.conv1.weight, network.conv1.weight)


# ----- the paper's defaults (issue 51, item 3) --------------------------------------------------------------------
def test_defaults_are_the_papers_and_the_codes_where_the_card_says_so() -> None:
    """spec §2(c): λ_f = 3 in every setting (ablation 0, 1, 3; 7 hurts); the auxiliary head's BSM at weight 1 and
    clipping at 5.0 are the code's (spec §2(e)1, §2(e)6); MAS weighting by RF with no share cap is the paper's rule
    (Eq. 5); BSM's prior floor 1e-12 (spec §1.1); the teacher-BN bug off (spec §2(e)5)."""
    cfg = FedMasConfig()
    assert (cfg.lambda_f, cfg.aux_head_weight, cfg.aggregation, cfg.max_share) == (3.0, 1.0, "mas", 0.0)
    assert (cfg.eps, cfg.repo_compat_teacher_bn) == (1e-12, False)
    assert (cfg.drw_start, cfg.drw_beta) == (0.8, 0.9999)  # mas_drw: the code's 80 % and effective-number β
    assert get_method("fedmas").train_defaults == {"grad_clip": 5.0}
