"""FedMD's seams (issue 62, item 1), through the real path as in ``test_mdhfl_seams.py`` (whose builders these
reuse): which setting each stage of a round reads, what the digest step's consensus and the revisit's CE hand the
model's gradient, each site's own architecture, and the paper preset's shared settings a FedMD run compared with
MDH-FL takes (MDH-FL's paper, Tables 1-4: FedMD is its baseline under the same set-up)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medflare.console.cli import make_parser
from medflare.console.run_options import build_run_config
from medflare.methods.base import PerSite, RoundContext
from medflare.methods.mdhfl.protocol import DISTILL_PHASE, PROBS, PROBS_PHASE, PUBLIC_ROWS, SETUP_PHASE, TARGET
from medflare.methods.presets import PAPER
from medflare.plan import build_plan, task_of, validated
from medflare.server_round import RoundAggregation
from medflare.site_config import SiteFile

from .test_mdhfl_seams import (
    PAPER_VALUES,
    SITES,
    check_site_scores,
    check_stage_settings,
    gradient,
    planned,
    runtime,
    sgd_plan,
    trained_sites,
)


def test_each_stage_of_a_round_reads_its_own_setting_through_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Li and Wang 2019, Algorithm 1 (digest, then revisit, every round) with MDH-FL's exchange: round 0 is set-up,
    probabilities, distil, probabilities, train; 4 KL steps of batch 16 per chunk of 64 public rows, then
    E_l = max(N_public // N_p, 1) epochs of the local loss; one Adam kept across every KL step of the job and
    another across every local epoch (FedMD compiles each model once: kl_optimizer=persistent,
    fresh_optimizer=never)."""
    check_stage_settings("fedmd", monkeypatch)


def test_the_digest_step_distils_towards_the_constant_mean_of_every_sites_predictions() -> None:
    """Li and Wang 2019, Algorithm 1 (consensus = (1/m)·Σ_k f_k over all parties, the site's own included; the
    digest trains towards it): through the round core, site 1's KL target on a chunk is the mean of both sites'
    probabilities, its own included, and one SGD step of the digest moves every weight by
    −lr·∇(−Σ_c T_c·log softmax(z)_c) with T held fixed: the consensus, own predictions and all, gets no gradient."""
    plan = sgd_plan("fedmd", chunks=2, public_per_round=16)
    sites = {name: runtime(plan, name) for name in SITES[:2]}
    core = RoundAggregation.of_plan(plan)
    ctx = RoundContext(0, len(plan.rounds))
    core.start_round({}, ctx)
    core.start_phase(SETUP_PHASE)
    for name, site in sites.items():
        assert core.accept(name, *site.run_phase(SETUP_PHASE, {}, ctx)) is None
    rows = core.start_phase(PROBS_PHASE)
    task = RoundContext(0, len(plan.rounds), server_meta=core.task_header())
    sent = {}
    for name, site in sites.items():
        sent[name] = site.run_phase(PROBS_PHASE, rows, task)
        assert core.accept(name, *sent[name]) is None
    targets = core.start_phase(DISTILL_PHASE)
    assert isinstance(targets, PerSite) and int(rows[PUBLIC_ROWS][1]) == 8
    learner = sites["site-1"]
    target = targets.arrays["site-1"][TARGET].astype(np.float32)
    consensus = (sent["site-1"][0][PROBS].astype(np.float32) + sent["site-2"][0][PROBS].astype(np.float32)) / 2
    np.testing.assert_allclose(target, consensus, atol=2e-3)
    before = copy.deepcopy(learner.model)
    learner.run_phase(DISTILL_PHASE, targets.arrays["site-1"], task)
    first = int(rows[PUBLIC_ROWS][0])
    images = torch.stack([learner.data.public[first + i][0] for i in range(8)])
    before.train()
    by_hand = gradient(before, -(torch.as_tensor(target) * F.log_softmax(before(images), 1)).sum(1).mean())
    moved = dict(before.named_parameters())
    for name, parameter in learner.model.named_parameters():
        torch.testing.assert_close(parameter.detach() - moved[name].detach(), -0.5 * by_hand[name], rtol=1e-3,
                                   atol=1e-6, msg=name)


def test_the_revisit_step_moves_the_model_by_cross_entropy_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Li and Wang 2019, Algorithm 1 (revisit: train on the private data; FedMD's plain cross-entropy, the card's
    loss=ce): one SGD step of the local epochs moves every weight by −lr·∇CE of the batch it trained on; no reverse
    term reaches the model."""
    site = runtime(sgd_plan("fedmd"), "site-1")
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    compute = site.trainer.compute_loss

    def seen(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batches.append((images.clone(), labels.clone()))
        return compute(images, labels)

    monkeypatch.setattr(site.trainer, "compute_loss", seen)
    before = copy.deepcopy(site.model)
    site.trainer.train_round(RoundContext(0, 1))
    (images, labels), = batches
    before.train()
    by_hand = gradient(before, F.cross_entropy(before(images), labels))
    moved = dict(before.named_parameters())
    for name, parameter in site.model.named_parameters():
        torch.testing.assert_close(parameter.detach() - moved[name].detach(), -0.5 * by_hand[name], rtol=1e-3,
                                   atol=1e-6, msg=name)


def test_the_summary_scores_each_sites_own_model_and_averages_the_sites_unweighted() -> None:
    """MDH-FL paper §4.2 (Tables 2-4 score FedMD as MDH-FL: each client's accuracy, then their average): per site
    the top-1 and balanced accuracy of that site's own network on its own clean test split, ``site_mean`` their
    plain mean over sites (not the image-weighted pooled score)."""
    check_site_scores(trained_sites("fedmd")[1])


def test_each_fedmd_site_trains_its_own_architecture() -> None:
    """MDH-FL paper §4.1 (FedMD is compared on the same heterogeneous clients, Tables 2-4): under the scenario each
    FedMD site's runtime builds the network its plan names, ResNet-10, ResNet-12, ShuffleNetV2, MobileNetV2."""
    plan = planned("fedmd", "--scenario", "noisy-heterogeneous",
                   "--set", "data.source=synthetic:n=200,classes=5,size=8,n_val=5,n_test=5")
    names = {name: type(runtime(plan, name).model.backbone).__name__ for name in SITES}
    assert names == {"site-1": "ResNet", "site-2": "ResNet", "site-3": "ShuffleNetV2", "site-4": "MobileNetV2"}
    blocks = {name: [len(getattr(runtime(plan, name).model.backbone, f"layer{i}")) for i in range(1, 5)]
              for name in SITES[:2]}
    assert blocks == {"site-1": [1, 1, 1, 1], "site-2": [2, 1, 1, 1]}


def test_fedmd_compared_under_the_paper_preset_takes_its_shared_settings_and_keeps_its_own() -> None:
    """MDH-FL paper Table 1 and §4.1 (the baselines run the same set-up): ``medflare compare mdhfl fedmd --preset
    paper`` gives FedMD's sites the preset's shared settings, 40 rounds, 4 sites with the four architectures, 288-px
    images without augmentation, Adam 1e-3 at batch 16, and FedMD keeps its own options: CE, the mean consensus over
    every site, one Adam kept for its KL steps and one for its local epochs (fresh_optimizer=never, its card)."""
    args = make_parser().parse_args(["compare", "mdhfl", "fedmd", "--preset", PAPER,
                                     "--set", "data.public_fraction=0.2"])
    args.preset_lead = "mdhfl"
    run = validated(build_run_config(args, "fedmd"), check_files=False)
    plan = build_plan(run, task_of(run), run.robust)
    assert (plan.method, len(plan.rounds), len(plan.sites)) == ("fedmd", 40, 4)
    assert (plan.data["image_size"], plan.data["augment"]) == (288, "none")
    cfg = plan.method_cfg
    assert (cfg.loss, cfg.weighting, cfg.include_self, cfg.kl_optimizer) == ("ce", "mean", True, "persistent")
    for site in plan.sites:
        settings, _ = plan.localise(site.name, SiteFile(Path("."), None), simulated=True)
        assert settings.model == PAPER_VALUES["site_model"][site.name]
        train = settings.train
        assert (train.optimizer, train.lr, train.batch_size, train.fresh_optimizer) == ("adam", 1e-3, 16, "never")
