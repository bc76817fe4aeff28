"""FedProx's seams (issue 62; fedprox/ledger.toml): the proximal term's gradient through the real trainer, and the
default μ as a run's site trainer reads it."""

from __future__ import annotations

import torch

from medflare.methods.base import RoundContext
from medflare.methods.fedprox import FedProxConfig
from medflare.ops import model_params

from ._run_sites import default_job_site
from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site

MU = 0.5


def test_the_proximal_gradient_is_mu_times_the_distance_on_every_local_parameter_and_none_on_the_anchor() -> None:
    """Li et al. 2020, Eq. 2: ∇_w (μ/2)||w − w^t||² = μ(w − w^t). After a round through the trainer's loop, on a
    batch without labels (CE 0) every parameter of the site's model, backbone and head, gets exactly μ(w − w^t)
    with w^t the model received this round; the anchor w^t is a detached constant that no step moved."""
    site = make_site(n=12)
    model = tiny_classifier()
    trainer = make_trainer("fedprox", model, site, FedProxConfig(mu=MU), max_steps=3)
    received = {k: v + 0.1 for k, v in model_params(tiny_classifier(seed=4)).items()}
    trainer.receive(received)
    trainer.train_round(RoundContext(1, 3))
    images, labels = site.train.tensors
    model.zero_grad(set_to_none=True)
    trainer.compute_loss(images, torch.full_like(labels, -1)).backward()
    for name, param in model.named_parameters():
        anchor = trainer.global_params[name]
        assert not anchor.requires_grad and anchor.grad is None
        torch.testing.assert_close(anchor, torch.as_tensor(received[name]), rtol=0, atol=0)
        assert bool((param.detach() - anchor).abs().sum() > 0)  # the round moved it off the anchor
        torch.testing.assert_close(param.grad, MU * (param.detach() - anchor), rtol=1e-10, atol=1e-12)


def test_a_default_job_trains_with_the_fed_mas_sweeps_mu() -> None:
    """Preset: μ = 0.01, a value of the sweep the Fed-MAS appendix reports FedProx over (Table 8, μ ∈ {0.1, 0.01,
    0.001}), as the site trainer of a default job reads it through the run's plan."""
    assert default_job_site("fedprox").trainer.cfg.mu == 0.01
