"""FCA: the consistency term by hand, the stop-gradient into the personal head, one step against a hand-written
update, and the personal head staying at the site (not sent, not overwritten, not held by the server)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from medflare.contracts import ContractContext
from medflare.errors import ConfigError, PayloadError
from medflare.evaluation import SPECIALIZATION
from medflare.losses import balanced_softmax_loss
from medflare.methods.base import RoundContext
from medflare.methods.fca import FcaConfig, build_fca_model
from medflare.methods.fca.loss import REPO_INPUT_EPS, consistency_loss, fca_loss
from medflare.methods.fca.model import FcaNet
from medflare.ops import model_params
from medflare.plan import build_global_model
from medflare.registry import get_method

from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

FED = [[1.0, -0.5, 0.2], [0.0, 0.3, -1.2]]
PERSONAL = [[0.4, 0.1, -0.6], [-0.2, 0.9, 0.5]]


def _softmax(row: list[float]) -> list[float]:
    exps = [math.exp(v) for v in row]
    return [e / sum(exps) for e in exps]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def fca_net(seed: int = 0) -> FcaNet:
    torch.manual_seed(seed + 100)
    return FcaNet(tiny_classifier(seed=seed)).double()


# ----- the consistency term -------------------------------------------------------------------------------------
def test_kl_consistency_equals_the_hand_computed_divergence() -> None:
    # KL(p_personal || p_fed) per row = sum_k q_k (log q_k - log p_k); batch mean over the two rows.
    expected = 0.0
    for fed, personal in zip(FED, PERSONAL):
        p, q = _softmax(fed), _softmax(personal)
        expected += sum(qk * (math.log(qk) - math.log(pk)) for pk, qk in zip(p, q)) / len(FED)
    assert consistency_loss(_t(FED), _t(PERSONAL), "kl").item() == pytest.approx(expected, abs=1e-12)


def test_kl_consistency_with_temperature_softens_both_heads() -> None:
    expected = 0.0
    for fed, personal in zip(FED, PERSONAL):
        p, q = _softmax([v / 2 for v in fed]), _softmax([v / 2 for v in personal])
        expected += sum(qk * (math.log(qk) - math.log(pk)) for pk, qk in zip(p, q)) / len(FED)
    assert consistency_loss(_t(FED), _t(PERSONAL), "kl", temperature=2.0).item() == pytest.approx(expected, abs=1e-12)


def test_repo_consistency_is_the_notebooks_element_wise_mean() -> None:
    # nn.KLDivLoss()(p_fed + 1e-11, p_personal): mean over B x C of t * (log t - input).
    terms = []
    for fed, personal in zip(FED, PERSONAL):
        p, q = _softmax(fed), _softmax(personal)
        terms += [qk * (math.log(qk) - (pk + REPO_INPUT_EPS)) for pk, qk in zip(p, q)]
    expected = sum(terms) / len(terms)
    assert consistency_loss(_t(FED), _t(PERSONAL), "repo").item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("mode", ["kl", "repo"])
def test_consistency_sends_no_gradient_into_the_personal_head(mode: str) -> None:
    net = fca_net()
    fed_logits, personal_logits = net.forward_both(torch.randn(6, 4, dtype=torch.float64))
    loss = consistency_loss(fed_logits, personal_logits, mode)
    personal = list(net.personal_head.parameters())
    shared = [net.head.weight, net.head.bias, net.backbone[0].weight]
    grads = torch.autograd.grad(loss, personal + shared, allow_unused=True)
    assert all(g is None for g in grads[: len(personal)])  # the teacher is detached: no path at all
    assert all(g is not None and g.abs().sum() > 0 for g in grads[len(personal):])  # the student side learns


def test_personal_head_is_trained_by_its_own_balanced_softmax_only() -> None:
    net, counts = fca_net(), [5, 0, 2]
    fed_logits, personal_logits = net.forward_both(torch.randn(6, 4, dtype=torch.float64))
    targets = torch.tensor([0, 2, 0, 0, 2, 0])
    cfg = FcaConfig()
    total = fca_loss(fed_logits, personal_logits, targets, counts, lambda_fed=1.0, lambda_personal=3.0,
                     consistency_weight=1.0, consistency="kl", temperature=1.0, eps=cfg.eps)
    own = 3.0 * balanced_softmax_loss(personal_logits, targets, counts, eps=cfg.eps)
    weight = net.personal_head.weight
    (from_total,) = torch.autograd.grad(total, weight, retain_graph=True)
    (from_own,) = torch.autograd.grad(own, weight)
    assert torch.allclose(from_total, from_own, atol=1e-14)


def test_fca_loss_is_the_weighted_sum_of_its_terms() -> None:
    fed, personal, targets, counts = _t(FED), _t(PERSONAL), torch.tensor([0, 1]), [3, 1, 0]
    kl = consistency_loss(fed, personal, "kl").item()
    expected = (0.5 * balanced_softmax_loss(fed, targets, counts, eps=1e-9).item()
                + 2.0 * balanced_softmax_loss(personal, targets, counts, eps=1e-9).item() + 0.7 * kl)
    loss = fca_loss(fed, personal, targets, counts, lambda_fed=0.5, lambda_personal=2.0, consistency_weight=0.7,
                    consistency="kl", temperature=1.0, eps=1e-9)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("model", ["cnn", "vit_micro", "efficientnet_lite0"])  # a CNN, a ViT, FCA's default
def test_any_factory_model_gets_a_parallel_personal_head(model: str) -> None:
    torch.manual_seed(0)
    net = build_fca_model(model, 4, 3, 32, None, FcaConfig()).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fed, personal = net.forward_both(images)
        assert fed.shape == personal.shape == (2, 4)
        assert torch.allclose(net(images), fed)  # the global model predicts with the federated head
    assert net.personal_head.in_features == net.head.in_features
    assert get_method("fca").payload.is_private("personal_head.weight")


# ----- one local step -------------------------------------------------------------------------------------------
def test_one_sgd_step_matches_the_hand_written_update() -> None:
    site = make_site(n=12, labels=[0, 0, 0, 1, 0, 2, 0, 1, 0, 0, -1, 0])
    net = fca_net()
    reference = fca_net()
    trainer = make_trainer("fca", net, site, FcaConfig(), max_steps=1)  # the defaults: λ₁ = 1, λ₂ = 3
    trainer.train_round(RoundContext(0, 1))

    x, y = site.train.tensors
    keep = y >= 0
    counts = torch.tensor(site.class_counts, dtype=torch.float64)
    features = torch.tanh(x[keep] @ reference.backbone[0].weight.T + reference.backbone[0].bias)
    z_fed = features @ reference.head.weight.T + reference.head.bias
    z_personal = features @ reference.personal_head.weight.T + reference.personal_head.bias
    prior = torch.log(counts / counts.sum() + 1e-9)
    q = torch.softmax(z_personal.detach(), dim=1)
    by_hand = (torch.nn.functional.cross_entropy(z_fed + prior, y[keep])
               + 3.0 * torch.nn.functional.cross_entropy(z_personal + prior, y[keep])
               + (q * (torch.log(q) - torch.log_softmax(z_fed, dim=1))).sum(dim=1).mean())
    params = dict(reference.named_parameters())
    grads = torch.autograd.grad(by_hand, list(params.values()))
    for (name, before), grad in zip(params.items(), grads):
        assert torch.allclose(dict(net.named_parameters())[name], before - 0.1 * grad, atol=1e-12), name


# ----- the personal head stays at the site ----------------------------------------------------------------------
def test_personal_head_is_never_sent_and_never_overwritten() -> None:
    site = make_site()
    trainer = make_trainer("fca", fca_net(), site)
    spec = get_method("fca")
    sent = trainer.outgoing_arrays()
    assert sent and not any(k.startswith("personal_head.") for k in sent)
    assert {"head.weight", "head.bias"} <= set(sent)
    mine = model_params(trainer.model, keep=lambda k: k.startswith("personal_head."))
    forged = {k: np.full_like(v, 7.0) for k, v in model_params(fca_net(seed=1)).items()}
    trainer.receive(forged)  # even if a server sent a personal head, the site keeps its own
    for key, value in model_params(trainer.model, keep=lambda k: k.startswith("personal_head.")).items():
        assert np.array_equal(value, mine[key])
    assert np.all(trainer.model.head.weight.detach().numpy() == 7.0)  # the federated head is loaded
    with pytest.raises(PayloadError, match="personal_head"):
        spec.payload.check_outgoing({**sent, **mine}, {}, list(trainer.model.state_dict()), ContractContext(3))


def test_the_server_model_holds_no_personal_head() -> None:
    keys = list(build_global_model("fca", "cnn", 3, 1, 28).state_dict())
    assert "head.weight" in keys and not any(k.startswith("personal_head.") for k in keys)
    network_keys = build_fca_model("cnn", 3, 1, 28, None, FcaConfig()).state_dict()
    assert {"personal_head.weight", "personal_head.bias"} <= set(network_keys)


def test_specialization_scores_the_personal_head_and_the_global_evaluation_the_federated_head() -> None:
    site = make_site(n=9)
    net = fca_net()
    with torch.no_grad():
        for head, favourite in ((net.head, 1), (net.personal_head, 0)):
            head.weight.zero_()
            head.bias.copy_(torch.tensor([-50.0, -50.0, -50.0]))
            head.bias[favourite] = 50.0
    trainer = make_trainer("fca", net, site)
    personal = trainer.extra_evaluations("test")[SPECIALIZATION].confusion
    federated = trainer.evaluate("test").confusion
    assert personal[:, 0].sum() == 9 and federated[:, 1].sum() == 9
    assert trainer.evaluate("test").confusion[:, 1].sum() == 9  # scoring the personal head left no trace


def test_personal_head_and_local_model_survive_a_state_round_trip() -> None:
    site = make_site()
    trainer = make_trainer("fca", fca_net(), site, max_steps=2)
    trainer.train_round(RoundContext(0, 2))
    state = trainer.state_dict()
    assert set(state["private"]) == {"personal_head.weight", "personal_head.bias"}
    fresh = make_trainer("fca", fca_net(seed=5), site)
    fresh.load_state(state)
    trained, restored = model_params(trainer.model), model_params(fresh.model)
    assert all(np.array_equal(restored[k], v) for k, v in trained.items())  # personal head and local extractor
    # so the specialization evaluation after a restart scores the model the site last trained
    assert np.array_equal(fresh.extra_evaluations("test")[SPECIALIZATION].confusion,
                          trainer.extra_evaluations("test")[SPECIALIZATION].confusion)


@pytest.mark.parametrize("field, value", [
    ("consistency", "js"), ("lambda_fed", -1.0), ("lambda_personal", float("nan")), ("temperature", 0.0),
])
def test_bad_config_is_refused_with_the_field_name(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        FcaConfig(**{field: value})


@pytest.mark.parametrize("extra, model", [([], "efficientnet_lite0"),
                                          (["--scenario", "ich-split2-like"], "efficientnet_lite0"),
                                          (["--model", "cnn"], "cnn")])
def test_the_command_line_trains_the_papers_backbone_unless_told_otherwise(extra: list[str], model: str) -> None:
    from medflare.console.cli import make_parser
    from medflare.console.run_options import build_run_config

    assert build_run_config(make_parser().parse_args(["run", "fca", *extra])).model == model


def test_train_defaults_follow_the_paper() -> None:
    defaults = get_method("fca").train_defaults
    assert defaults["lr_schedule"] == "multistep" and tuple(defaults["milestones"]) == (60, 70)
    assert defaults["optimizer"] == "adam" and defaults["weight_decay"] == 5e-4 and defaults["gamma"] == 0.1
