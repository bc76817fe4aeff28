"""MOON's seams (issue 62; moon/ledger.toml): through the trainer's loop, the global and previous models are
references only (no gradient, no update of their BatchNorm statistics, scored in eval mode), and the defaults a
default job's site reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medflare.methods.base import RoundContext
from medflare.methods.moon import MoonConfig
from medflare.models import Classifier
from medflare.ops import model_params

from ._run_sites import default_job_site
from ._trainers import make_trainer
from .conftest import make_site

TAU = 0.5


def _batchnorm_classifier(seed: int) -> Classifier:
    torch.manual_seed(seed)
    return Classifier(nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh()), nn.Linear(5, 3)).double()


def test_the_reference_models_get_no_gradient_and_keep_their_statistics_through_a_round() -> None:
    """Li et al. 2021, Algorithm 1 and Eq. 3: z_glob and z_prev come from the fixed global model w^t and the
    site's previous model w_i^{t-1}; only the local model learns. After a round through the trainer's loop the
    frozen global copy is exactly the received model (parameters and BatchNorm statistics), and on a batch
    without labels (CE 0) the trainer's loss and gradient are μ·ℓ_con with z_glob, z_prev the received and the
    previous model in eval mode."""
    site = make_site(n=12)
    model = _batchnorm_classifier(0)
    trainer = make_trainer("moon", model, site, MoonConfig(mu=1.0, temperature=TAU), max_steps=2)
    trainer.train_round(RoundContext(0, 3))
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    received = {k: v.numpy() for k, v in _batchnorm_classifier(5).state_dict().items()}
    trainer.receive(received)
    trainer.train_round(RoundContext(1, 3))  # the loop steps with ℓ_con, both reference models in use
    global_copy = trainer.global_model
    assert not global_copy.training
    assert all(torch.equal(v, torch.as_tensor(received[k])) for k, v in global_copy.state_dict().items())
    assert all(p.grad is None and not p.requires_grad for p in global_copy.parameters())
    reference_global, reference_previous = _batchnorm_classifier(5), _batchnorm_classifier(0)
    reference_global.load_state_dict({k: torch.as_tensor(v) for k, v in received.items()})
    reference_previous.load_state_dict(previous)
    trainer.previous_model.load_state_dict(previous)  # the round's end moved it on; score the step as it ran
    images, labels = site.train.tensors
    model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(images, torch.full_like(labels, -1))
    loss.backward()
    z = model.forward_features(images)
    with torch.no_grad():
        z_global = reference_global.eval().forward_features(images)
        z_previous = reference_previous.eval().forward_features(images)
    similarities = torch.stack((F.cosine_similarity(z, z_global, dim=1), F.cosine_similarity(z, z_previous, dim=1)), 1)
    expected = F.cross_entropy(similarities / TAU, torch.zeros(len(images), dtype=torch.long))
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(expected, list(model.backbone.parameters()))
    for param, grad in zip(model.backbone.parameters(), grads):
        torch.testing.assert_close(param.grad, grad, rtol=1e-8, atol=1e-12)
    assert all(p.grad is None for p in [*trainer.global_model.parameters(), *trainer.previous_model.parameters()])
    assert model_params(trainer.global_model).keys() == model_params(model).keys()


def test_a_default_job_trains_with_mu_one_and_tau_one_half() -> None:
    """Preset: τ = 0.5 (MOON, Li et al. 2021, and the Fed-MAS repository; spec §1.10) and μ = 1 (Fed-MAS Table 8:
    μ ∈ {0.01, 0.1, 1}, μ = 1 best for the global model), as a default job's site trainer reads them."""
    cfg = default_job_site("moon").trainer.cfg
    assert (cfg.mu, cfg.temperature) == (1.0, 0.5)
