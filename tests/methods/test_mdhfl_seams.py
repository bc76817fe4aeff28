"""MDH-FL's seams (issue 62, item 1): what arrives where one part hands over to the next, through the real path.
A run's options as the command line layers them (``--scenario noisy-heterogeneous``, ``--preset paper``, ``--set``),
the plan, each site's settings (``RunPlan.localise``), the site's data build and runtime (``SiteRuntime``), the
server's round core (``RoundAggregation``) and the evaluation as the controller sums it (``evaluation.summarize``).

Seams: the label-noise option on the labels a site trains on; how per-site scores are combined; which setting each
stage of a round reads (KL steps, local epochs) and the local-epochs rule; which terms' gradients reach the model;
each site's own architecture; every value of the paper preset against the paper's tables."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medflare import contracts
from medflare.console.cli import make_parser
from medflare.console.run_options import build_run_config
from medflare.evaluation import site_evaluation, summarize
from medflare.methods.base import PerSite, RoundContext
from medflare.methods.mdhfl import client as mdhfl_client
from medflare.methods.mdhfl.client import MdhflTrainer
from medflare.methods.mdhfl.protocol import DISTILL_PHASE, PROBS_PHASE, PUBLIC_ROWS, SETUP_PHASE, TARGET
from medflare.methods.presets import PAPER
from medflare.plan import RunPlan, build_plan, task_of, validated
from medflare.registry import get_method
from medflare.server_round import RoundAggregation
from medflare.site_config import SiteFile
from medflare.site_runtime import SiteRuntime, load_site_data

from .test_mdhfl_invariants import hand_sce

K = 5
SITES = ("site-1", "site-2", "site-3", "site-4")
# The scenario's source made small: 12-px synthetic images, 22 test images (unequal per-site test slices: 6, 6, 5, 5)
SMALL = "synthetic:n=600,classes=5,size=12,n_val=20,n_test=22"


def planned(method: str, *options: str) -> RunPlan:
    """The plan ``medflare run METHOD OPTIONS`` resolves to (every layer: preset, scenario, flags, --set)."""
    run = validated(build_run_config(make_parser().parse_args(["run", method, *options])), check_files=False)
    return build_plan(run, task_of(run), run.robust)


def runtime(plan: RunPlan, site: str) -> SiteRuntime:
    """The simulator site ``site`` of ``plan`` as the executor builds it (its settings, data, model and trainer)."""
    settings, index = plan.localise(site, SiteFile(Path("."), None), simulated=True)
    return SiteRuntime(settings, site, index, log=lambda m: None)


def site_data(plan: RunPlan, site: str):
    """The data ``site`` of ``plan`` reads: the build its runtime runs (``load_site_data``)."""
    settings, index = plan.localise(site, SiteFile(Path("."), None), simulated=True)
    return load_site_data(settings, index, site)


def play_round(plan: RunPlan, core: RoundAggregation, sites: dict[str, SiteRuntime], round_index: int) -> list[str]:
    """One round as the controller runs it: the rule's phases in order, each task to every site (its own part of a
    per-site task), every result through the core's checks. Returns the phases played."""
    scheduled = plan.rounds[round_index]
    ctx = RoundContext(round_index, len(plan.rounds), stage=scheduled.stage, scored=scheduled.scored)
    ctx = dataclasses.replace(ctx, server_meta=core.rule.server_meta(ctx))
    core.start_round({}, ctx)
    phases = core.rule.phases(ctx)
    for phase in phases:
        outgoing = core.start_phase(phase)
        task = dataclasses.replace(ctx, server_meta={**ctx.server_meta, **core.task_header()})
        for name, site in sites.items():
            arrays = outgoing.arrays.get(name, {}) if isinstance(outgoing, PerSite) else outgoing
            result = site.train(arrays, task) if phase == contracts.TRAIN_PHASE else site.run_phase(phase, arrays, task)
            assert core.accept(name, *result) is None, (phase, name)
    return phases


# ----- data option: label noise (kind and rate) on the labels a site trains on ---------------------------------
def flips(plan: RunPlan, clean: RunPlan, site: str) -> tuple[np.ndarray, np.ndarray]:
    """(clean, noisy) training labels of ``site``: the same site of the same job without and with label noise."""
    noisy_data, clean_data = site_data(plan, site), site_data(clean, site)
    noisy, true = np.asarray(noisy_data.train.labels), np.asarray(clean_data.train.labels)
    assert len(noisy) == len(true) > 100
    for split in ("val", "test"):  # evaluation labels stay clean
        np.testing.assert_array_equal(getattr(noisy_data, split).labels, getattr(clean_data, split).labels)
    return true, noisy


def within_binomial(count: int, n: int, rate: float) -> bool:
    """``count`` flips of ``n`` labels is a plausible draw at ``rate`` (4 standard deviations, plus 1 %)."""
    return abs(count / n - rate) <= 4 * np.sqrt(rate * (1 - rate) / n) + 0.01


@pytest.mark.parametrize("kind", ["pairflip", "symmetric"])
def test_each_sites_own_noise_rate_and_kind_reach_the_labels_it_trains_on(kind: str) -> None:
    """Paper §4.1 and Table 1 (μ ∈ {0.1, 0.2, 0.3}, pair or symmetric flip; spec §1.3): with one rate per site,
    each site's training labels differ from its clean ones at its own rate; pair flip moves class i to (i + 1) mod K
    only, symmetric flip to every other class. Evaluation labels stay clean."""
    rates = [0.1, 0.2, 0.3, 0.4]
    options = ["--scenario", "noisy-heterogeneous", "--partition", "iid", "--model", "cnn", "--set", "site_model={}",
               "--set", "data.source=synthetic:n=4000,classes=5,size=8,n_val=5,n_test=5"]
    plan = planned("mdhfl", *options, "--set", f"data.label_noise={rates}", "--set", f"data.noise_kind={kind}")
    clean = planned("mdhfl", *options, "--set", "data.label_noise=0")
    for site, rate in zip(SITES, rates):
        true, noisy = flips(plan, clean, site)
        flipped = noisy != true
        assert within_binomial(int(flipped.sum()), len(true), rate), (site, flipped.mean(), rate)
        to_next = noisy[flipped] == (true[flipped] + 1) % K
        if kind == "pairflip":
            assert to_next.all(), f"{site}: a pair flip went elsewhere than (i + 1) mod K"
        else:
            assert set(((noisy[flipped] - true[flipped]) % K).tolist()) == {1, 2, 3, 4}, site
            assert within_binomial(int(to_next.sum()), int(flipped.sum()), 1 / (K - 1)), site


def test_the_noisy_heterogeneous_scenarios_pair_flips_at_0_2_reach_every_site() -> None:
    """The scenario's data options (pair flip, μ = 0.2: the paper's middle rate, Table 3) reach every site's labels:
    pooled over the four sites, 20 % of the training labels flipped, each to the next class."""
    plan = planned("mdhfl", "--scenario", "noisy-heterogeneous", "--model", "cnn", "--set", "site_model={}")
    clean = planned("mdhfl", "--scenario", "noisy-heterogeneous", "--model", "cnn", "--set", "site_model={}",
                    "--set", "data.label_noise=0")
    pairs = [flips(plan, clean, site) for site in SITES]
    true, noisy = (np.concatenate(part) for part in zip(*pairs))
    flipped = noisy != true
    assert within_binomial(int(flipped.sum()), len(true), 0.2), flipped.mean()
    assert (noisy[flipped] == (true[flipped] + 1) % K).all()


# ----- evaluation aggregation: each site's own model on its own clean test split, the unweighted mean ----------
def hand_scores(site: SiteRuntime) -> tuple[float, float, int]:
    """(top-1 accuracy, balanced accuracy over the classes present, test images) of the site's own model on its
    own test split, by hand."""
    loader = torch.utils.data.DataLoader(site.data.test, batch_size=64)
    site.model.eval()
    with torch.no_grad():
        pairs = [(site.model(x).argmax(1), y) for x, y in loader]
    predicted, labels = (torch.cat(part).numpy() for part in zip(*pairs))
    recalls = [float((predicted[labels == k] == k).mean()) for k in np.unique(labels)]
    return float((predicted == labels).mean()), float(np.mean(recalls)), len(labels)


def trained_sites(method: str) -> tuple[RunPlan, dict[str, SiteRuntime]]:
    """The scenario's four sites, each after a few local steps (untrained, MobileNetV2 answers equal logits)."""
    plan = planned(method, "--scenario", "noisy-heterogeneous", "--set", f"data.source={SMALL}",
                   "--set", "train.max_steps=4")
    sites = {site: runtime(plan, site) for site in SITES}
    for site in sites.values():
        site.train({}, RoundContext(0, 1))
    return plan, sites


@pytest.fixture(scope="module")
def scenario_sites() -> tuple[RunPlan, dict[str, SiteRuntime]]:
    return trained_sites("mdhfl")


def check_site_scores(sites: dict[str, SiteRuntime]) -> None:
    """The controller's summary of the sites' validate results against each site's own model scored by hand."""
    evaluations = {name: site_evaluation(site.validate({}), K) for name, site in sites.items()}
    final = summarize(evaluations)
    by_hand = {name: hand_scores(site) for name, site in sites.items()}
    assert len({images for _, _, images in by_hand.values()}) > 1  # unequal test slices: weighted ≠ unweighted
    for name, (accuracy, balanced, _) in by_hand.items():
        assert final["by_site"][name]["accuracy"] == pytest.approx(accuracy, abs=1e-9), name
        assert final["by_site"][name]["balanced_accuracy"] == pytest.approx(balanced, abs=1e-9), name
    mean = np.mean([accuracy for accuracy, _, _ in by_hand.values()])
    assert final["site_mean"]["accuracy"] == pytest.approx(mean, abs=1e-9)
    assert final["site_mean"]["balanced_accuracy"] == pytest.approx(np.mean([b for _, b, _ in by_hand.values()]))
    pooled = sum(a * n for a, _, n in by_hand.values()) / sum(n for _, _, n in by_hand.values())
    assert final["test"]["accuracy"] == pytest.approx(pooled, abs=1e-9) and abs(pooled - mean) > 1e-6


def test_the_summary_scores_each_sites_own_model_and_averages_the_sites_unweighted(scenario_sites) -> None:
    """Paper §4.2 (Tables 2-4: each client's accuracy, then their average; spec §3(a) step 5 and §3(d): each
    client's model on the clean held-out test split, plus the mean): the controller's summary of the sites'
    validate results holds, per site, the top-1 (and balanced) accuracy of that site's own architecture on its own
    test images, and ``site_mean`` is their plain mean over sites, not the pooled (image-weighted) score."""
    check_site_scores(scenario_sites[1])


# ----- architecture: each site's own network, the paper's four ---------------------------------------------------
def blocks(model: nn.Module) -> list[int]:
    return [len(getattr(model.backbone, f"layer{i}")) for i in range(1, 5)]


def test_each_site_trains_its_own_architecture_the_papers_four(scenario_sites) -> None:
    """Paper §4.1 (heterogeneous clients: ShuffleNet, ResNet10, MobileNetV2, ResNet12; spec §3(a): in the code's
    order ResNet10, ResNet12, ShuffleNet, MobileNetV2): the site runtime builds the architecture its plan names:
    CIFAR-style ResNet-10 (BasicBlocks [1, 1, 1, 1]) and ResNet-12 ([2, 1, 1, 1]) with a 3x3 stride-1 stem, no
    max-pooling and 4x4 pooling into an 8192-wide head, torchvision's ShuffleNetV2 and MobileNetV2 (adaptive
    pooling); each answers K logits on the job's images and reports its own size."""
    import torchvision

    plan, sites = scenario_sites
    assert {s.name: s.model for s in plan.sites} == dict(zip(SITES, ("resnet10", "resnet12", "shufflenet",
                                                                     "mobilenet_v2")))
    models = {name: site.model for name, site in sites.items()}
    for name, expected in (("site-1", [1, 1, 1, 1]), ("site-2", [2, 1, 1, 1])):
        backbone = models[name].backbone
        assert blocks(models[name]) == expected and isinstance(backbone.layer1[0], torchvision.models.resnet.BasicBlock)
        assert (backbone.conv1.kernel_size, backbone.conv1.stride) == ((3, 3), (1, 1))
        assert isinstance(backbone.maxpool, nn.Identity) and models[name].head.in_features == 512 * 4 * 4
    assert isinstance(models["site-3"].backbone, torchvision.models.ShuffleNetV2)
    assert isinstance(models["site-4"].backbone, torchvision.models.MobileNetV2)
    images = torch.stack([sites["site-1"].data.test[i][0] for i in range(2)])
    sizes = set()
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            assert model(images).shape == (2, K), name
        sizes.add(sum(p.numel() for p in model.parameters()))
    assert len(sizes) == 4  # four different networks


# ----- stage schedule: the exchange's phases, the KL steps' and the local epochs' settings --------------------
def spy_steps(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, str, object]]) -> None:
    """Record, per training step, (site, 'kl' | 'local', the optimizer stepped: kept, so no two share an id)."""
    step = MdhflTrainer.optimizer_step

    def recorded(self, optimizer, loss_fn):
        kind = "kl" if getattr(self, "_in_kl", False) else "local"
        events.append((self.data.site_name, kind, optimizer))
        return step(self, optimizer, loss_fn)

    distill = MdhflTrainer._distill

    def marked(self, target):
        self._in_kl = True
        try:
            return distill(self, target)
        finally:
            self._in_kl = False

    monkeypatch.setattr(MdhflTrainer, "optimizer_step", recorded)
    monkeypatch.setattr(MdhflTrainer, "_distill", marked)


def exchange_plan(method: str) -> RunPlan:
    """Two rounds of ``method`` on the scenario's four sites (small CNNs, for speed): 2 chunks of 64 of the 128 public rows a round
    (batch 16: 4 KL steps a chunk), half the training split held out as the public set (200 of 400 images)."""
    return planned(method, "--scenario", "noisy-heterogeneous", "--rounds", "2", "--model", "cnn", "--set", "site_model={}",
                   "--set", "data.source=synthetic:n=400,classes=5,size=8,n_val=5,n_test=5",
                   "--set", "data.public_fraction=0.5", "--set", "method.chunks=2",
                   "--set", "method.public_per_round=128")


def test_each_stage_of_a_round_reads_its_own_setting_through_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spec §3(a) steps 3-4 and §3(b) (chunks), through the plan, the round core and the site runtimes: round 0
    is set-up, probabilities, distil, probabilities, train; every chunk takes 64 public rows in 4 KL steps of batch
    16, the train task first the last chunk's KL steps, then E_l = max(N_public // N_p, 1) local epochs with
    N_public the 128 rows a round exchanges and N_p the site's own training images; a new Adam for every KL step
    and for the local epochs of every round (the code's)."""
    check_stage_settings("mdhfl", monkeypatch)


def check_stage_settings(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds of ``method`` (:func:`exchange_plan`) through the runtime: the phases, the KL steps and local
    epochs of each train task and which optimizer each stepped (MDH-FL: new ones; FedMD: one for each loop)."""
    plan = exchange_plan(method)
    sites = {name: runtime(plan, name) for name in SITES}
    core = RoundAggregation.of_plan(plan)
    events: list[tuple[str, str, object]] = []
    spy_steps(monkeypatch, events)
    epochs: dict[str, list[int]] = {name: [] for name in SITES}
    for name, site in sites.items():
        site.trainer.epoch_listener = lambda epoch, loss, name=name: epochs[name].append(epoch)
    exchange = [PROBS_PHASE, DISTILL_PHASE, PROBS_PHASE, contracts.TRAIN_PHASE]
    local_optimizers: dict[str, list[int]] = {name: [] for name in SITES}
    for round_index in range(2):
        assert play_round(plan, core, sites, round_index) == ([SETUP_PHASE] if round_index == 0 else []) + exchange
        assert list(plan.rounds[round_index].phases) == ([SETUP_PHASE] if round_index == 0 else []) + exchange
        for name, site in sites.items():
            local_optimizers[name].append(id(site.trainer.optimizer))
    for name, site in sites.items():
        private = len(site.data.train)
        e_l = max(128 // private, 1)
        assert site.trainer.train_cfg.local_epochs == e_l and e_l > 1, (name, private)
        assert epochs[name] == list(range(2 * e_l)), name
        steps = [(kind, id(optimizer)) for who, kind, optimizer in events if who == name]
        per_epoch = private // 16 if private > 16 else 1
        one_round = ["kl"] * 8 + ["local"] * (e_l * per_epoch)
        assert [kind for kind, _ in steps] == one_round * 2, name
        kl = [optimizer for kind, optimizer in steps if kind == "kl"]
        local = [optimizer for kind, optimizer in steps if kind == "local"]
        if method == "mdhfl":
            assert local_optimizers[name][0] != local_optimizers[name][1], f"{name}: the local Adam survived a round"
            assert len(set(local)) == 2 and len(set(kl)) == len(kl) and not set(local) & set(kl), name
        else:
            assert len(set(kl)) == 1 and len(set(local)) == 1 and set(kl) != set(local), name


def test_the_local_epochs_follow_the_rows_a_round_exchanges_not_the_whole_public_set() -> None:
    """E_l = max(⌊N_0 / N_p⌋, 1) (spec §3(a) step 4 and §3(e); the card's deviation 'Local epochs E_l': the paper's
    Table 1 prints the inverse, N_p / N_0, which is below one epoch): N_0 is the public rows a round exchanges
    (``public_per_round``), so a site of N_p private images trains as many private images a round as the round's
    KL steps distil public ones. ``method.local_epochs`` and ``--local-epochs`` set it directly."""
    base = ["--scenario", "noisy-heterogeneous", "--model", "cnn", "--set", "site_model={}",
            "--set", "data.source=synthetic:n=400,classes=5,size=8,n_val=5,n_test=5", "--set", "data.public_fraction=0.5"]
    for options, rule in (([], lambda public, private: max(200 // private, 1)),
                          (["--set", "method.public_per_round=96"], lambda public, private: max(96 // private, 1)),
                          (["--set", "method.local_epochs=3"], lambda public, private: 3),
                          (["--local-epochs", "2"], lambda public, private: 2)):
        plan = planned("mdhfl", *base, *options)
        for name in SITES:
            site = runtime(plan, name)
            assert len(site.data.public) == 200
            expected = rule(len(site.data.public), len(site.data.train))
            assert site.trainer.train_cfg.local_epochs == expected, (options, name)


# ----- gradient reach: both SCE terms reach the model; the teachers' target gets no gradient -----------------
def sgd_plan(method: str = "mdhfl", **method_args: object) -> RunPlan:
    """The scenario with plain SGD (lr 0.5, no momentum), batch 8, one local step a round."""
    options = ["--scenario", "noisy-heterogeneous", "--set", f"data.source={SMALL}", "--set", "train.optimizer=sgd",
               "--set", "train.momentum=0", "--set", "train.lr=0.5", "--set", "train.batch_size=8",
               "--set", "train.max_steps=1", "--set", "method.local_epochs=1"]
    options += [item for key, value in method_args.items() for item in ("--set", f"method.{key}={value}")]
    return planned(method, *options)


def sgd_site(**method_args: object) -> SiteRuntime:
    """Site 1 (ResNet-10) of :func:`sgd_plan`."""
    return runtime(sgd_plan(**method_args), "site-1")


def gradient(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True, retain_graph=True)
    return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(named, grads)}


@pytest.mark.parametrize("alpha, beta", [(0.1, 1.0), (1.0, 0.0), (0.0, 1.0)])
def test_a_local_step_moves_the_model_by_both_sce_terms(alpha: float, beta: float,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Paper Eq. 7-8 (L_s = λ·L_c + L_rc, λ = 0.1; spec §1 item 4): one SGD step of the site's local epochs
    moves every weight by −lr·(α·∇CE + β·∇RCE) of the batch it trained on; each term alone also moves it, so
    neither term's gradient is cut off (a detached softmax in RCE, detached logits in CE)."""
    site = sgd_site(sce_alpha=alpha, sce_beta=beta)
    trainer = site.trainer
    before = copy.deepcopy(trainer.model)
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    compute = trainer.compute_loss

    def seen(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batches.append((images.clone(), labels.clone()))
        return compute(images, labels)

    monkeypatch.setattr(trainer, "compute_loss", seen)
    trainer.train_round(RoundContext(0, 1))
    assert len(batches) == 1
    images, labels = batches[0]
    before.train()
    logits = before(images)
    probs = torch.softmax(logits, 1).clamp(min=1e-7)
    ce = F.cross_entropy(logits, labels)
    rce = -(probs * torch.log(F.one_hot(labels, K).to(probs.dtype).clamp(min=1e-4))).sum(1).mean()
    assert float((alpha * ce + beta * rce).detach()) == pytest.approx(hand_sce(logits.detach(), labels, alpha, beta), rel=1e-5)
    ce_grad, rce_grad = gradient(before, ce), gradient(before, rce)
    moved = 0
    for name, parameter in trainer.model.named_parameters():
        expected = -0.5 * (alpha * ce_grad[name] + beta * rce_grad[name])
        delta = parameter.detach() - dict(before.named_parameters())[name].detach()
        torch.testing.assert_close(delta, expected, rtol=1e-3, atol=1e-6, msg=name)
        moved += int(expected.abs().sum() > 0)
    assert moved > 0
    assert sum(float(g.abs().sum()) for g in rce_grad.values()) > 0 and sum(float(g.abs().sum()) for g in ce_grad.values()) > 0


def test_a_kl_step_treats_the_teachers_target_as_a_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paper Eq. 2-3 and spec §3(a) step 3 (t_i = softmax(logits_i), detached): the gradient a KL step takes is
    that of −Σ_c T_c·log softmax(z)_c with T the server's target held fixed, i.e. s·softmax(z) − T in the logits,
    and the target the loss gets carries no graph; the site's own shared probabilities carry none either."""
    site = sgd_site(public_per_round=8)
    trainer = site.trainer
    arrays, _ = trainer.run_phase(PROBS_PHASE, {PUBLIC_ROWS: np.array([0, 8])}, RoundContext(0, 1))
    assert isinstance(arrays["probs"], np.ndarray)
    target = np.full((8, K), 0.1, np.float32)
    target[:, 2] = 0.5  # rows sum to s = 0.9, as the others' weights give
    targets_seen: list[torch.Tensor] = []
    loss_fn = mdhfl_client.mixed_target_loss

    def spy(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        targets_seen.append(rows)
        return loss_fn(logits, rows)

    monkeypatch.setattr(mdhfl_client, "mixed_target_loss", spy)
    before = copy.deepcopy(trainer.model)
    trainer.run_phase(DISTILL_PHASE, {TARGET: target}, RoundContext(0, 1))
    assert len(targets_seen) == 1 and not targets_seen[0].requires_grad and targets_seen[0].grad_fn is None
    images = torch.stack([trainer.data.public[i][0] for i in range(8)])
    before.train()
    logits = before(images)
    constant = torch.as_tensor(target)
    by_hand = gradient(before, -(constant * F.log_softmax(logits, 1)).sum(1).mean())
    logit_grad = torch.autograd.grad(loss_fn(logits, constant), logits)[0]
    torch.testing.assert_close(logit_grad, (0.9 * torch.softmax(logits, 1) - constant).detach() / 8)
    for name, parameter in trainer.model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(parameter.grad, by_hand[name], rtol=1e-3, atol=1e-7, msg=name)


# ----- preset: every value of --preset paper against the paper's tables ----------------------------------------
PAPER_VALUES = {
    "model": "resnet12",  # §4.1: "for the homogeneous clients, ResNet-12 is used"
    # §4.1 heterogeneous clients (ShuffleNet, ResNet10, MobileNetV2, ResNet12), in the code's order (spec §3(a))
    "site_model": {"site-1": "resnet10", "site-2": "resnet12", "site-3": "shufflenet", "site-4": "mobilenet_v2"},
    "clients": 4,  # §4.1: "four clients are set up"
    "rounds": 40,  # Table 1: E_c = 40
    "data": {"image_size": 288, "augment": "none"},  # §4.1: 288 x 288 images; spec §3(a): no augmentation
    # Table 1: Adam, α = 0.001, b = 16 (the Adam's lifetime is the method's own: MDH-FL's train defaults)
    "train": {"optimizer": "adam", "lr": 1e-3, "batch_size": 16},
    "method_args": {
        "distill": True, "loss": "sce",  # Eq. 3 (KL) and Eq. 7-8 (L_s)
        "sce_alpha": 0.1, "sce_beta": 1.0,  # Table 1 λ = 0.1 on L_c; Eq. 7: L_rc with weight 1
        "weighting": "ccr", "ccr_beta": 0.5,  # the authors' code (RHFL's CCR, β = 0.5; spec §3(a) step 2, §3(c))
        "chunks": 8,  # spec §3(b): M = 8-16 chunks approximates the code's per-batch targets
        "public_per_round": 0,  # spec §3(d): all 26,379 INT_20 images each round
        "local_epochs": 0,  # Table 1's E_l by the code's rule max(N_0 // N_p, 1) (the card's deviation)
        "kl_optimizer": "step",  # spec §3(a) step 3: a brand-new Adam per KL step
        "pretrain_epochs": 0,  # spec §3(a): MDH-FL has no warm-up
    },
}


def test_every_value_of_the_paper_preset_is_the_papers_and_reaches_every_site() -> None:
    """Paper Table 1 and §4.1 (and the spec §3 lines for what the paper leaves to the code): every value of
    ``--preset paper``, then each site's settings from ``medflare run mdhfl --preset paper``: its own
    architecture, Adam 1e-3 at batch 16 for 40 rounds, a new Adam each round (spec §3(a) step 4: MDH-FL's train
    defaults), SCE λ = 0.1, CCR β = 0.5, 8 chunks."""
    preset = get_method("mdhfl").presets[PAPER]
    assert dict(preset.overrides) == PAPER_VALUES
    plan = planned("mdhfl", "--preset", PAPER, "--set", "data.public_fraction=0.2")
    assert (len(plan.rounds), len(plan.sites), plan.model) == (40, 4, "resnet12")
    assert plan.data["image_size"] == 288 and plan.data["augment"] == "none"
    for site in plan.sites:
        settings, _ = plan.localise(site.name, SiteFile(Path("."), None), simulated=True)
        assert settings.model == PAPER_VALUES["site_model"][site.name]
        train = settings.train
        assert (train.optimizer, train.lr, train.batch_size, train.fresh_optimizer) == ("adam", 1e-3, 16, "round")
        assert dataclasses.asdict(settings.method_args) | PAPER_VALUES["method_args"] == \
            dataclasses.asdict(settings.method_args)
