"""SSL-FL (Fed-MAE, Fed-BEiT): masking, losses, schedules, stages, the encoder hand-off and export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed

from medflare import contracts
from medflare.errors import ConfigError, DataError, PayloadError
from medflare.methods.base import RoundContext, SiteUpdate, Stage, TrainConfig
from medflare.methods.fed_mas.prior import build_prior
from medflare.methods.ssl_fl import (
    FED_BEIT,
    FED_MAE,
    FedBeitConfig,
    FedMaeConfig,
    build_fed_beit,
    build_fed_mae,
)
from medflare.methods.ssl_fl.client import N_IMAGES
from medflare.methods.ssl_fl.export import export_run, load_encoder, save_encoder
from medflare.methods.ssl_fl.masking import BlockMaskGenerator, beit_mask_count, random_mask
from medflare.methods.ssl_fl.model import masked_patch_loss, patchify
from medflare.methods.ssl_fl.server import SslFlRule
from medflare.methods.ssl_fl.tokenizer import DalleEncoder, DalleTokenizer, DiscreteVae, code_usage, load_dalle_encoder
from medflare.optim import lr_at, set_step_lr
from medflare.plan import build_global_model
from medflare.registry import get_method
from medflare.server_round import RoundAggregation
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

MODEL = "vit_micro"  # the CPU-sized ViT: 7 x 7 patches of 4 px at 28 px
TASK = TaskSpec(num_classes=3, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=120,classes=3", "num_sites": 2, "partition": "iid"}
QUICK = {"max_steps": 1, "batch_size": 8, "eval_batch_size": 64}


def _site(
    method: str, index: int = 0, method_args: dict | None = None, data: dict | None = None, **train: object
) -> SiteRuntime:
    settings = SiteSettings(
        spec=get_method(method), task=TASK, data={**DATA, **(data or {})}, model=MODEL, method_args=method_args or {},
        train={**QUICK, **train}, evaluation="off",
    )
    return SiteRuntime(settings, f"site-{index + 1}", index, log=lambda message: None)


def _global(method: str, method_args: dict | None = None) -> dict[str, np.ndarray]:
    network = build_global_model(method, MODEL, TASK.num_classes, TASK.in_channels, TASK.image_size, method_args=method_args)
    return {k: v.numpy() for k, v in network.state_dict().items()}


# ----- masking ----------------------------------------------------------------------------------------
def test_random_mask_hides_the_ratio_of_every_sample_and_restores_the_order() -> None:
    torch.manual_seed(0)
    mask = random_mask(batch=6, num_patches=49, ratio=0.6)
    visible = int(49 * 0.4)
    assert mask.keep.shape == (6, visible)
    assert torch.equal(mask.masked.sum(dim=1), torch.full((6,), 49.0 - visible))
    assert torch.all(torch.gather(mask.masked, 1, mask.keep) == 0)  # the kept patches are the unmasked ones
    assert all(len(set(row.tolist())) == visible for row in mask.keep)
    order = torch.cat([mask.keep, torch.gather(torch.argsort(mask.restore, 1), 1, torch.arange(visible, 49).expand(6, -1))], 1)
    assert torch.equal(torch.gather(order, 1, mask.restore), torch.arange(49).expand(6, -1))  # restore unshuffles
    assert not torch.equal(mask.keep[0], mask.keep[1])  # each sample draws its own mask


@pytest.mark.parametrize(("patches", "ratio", "count"), [(196, 0.4, 80), (196, 0.5, 100), (49, 0.4, 20), (49, 0.99, 48)])
def test_beit_mask_count_is_the_ratio_rounded_to_fives(patches: int, ratio: float, count: int) -> None:
    assert beit_mask_count(patches, ratio) == count


def _masked_neighbours(mask: np.ndarray, grid: int) -> float:
    """Mean number of masked 4-neighbours of a masked patch (about 1.5 for random masks at these ratios)."""
    padded = np.pad(mask.reshape(grid, grid), 1)
    counts = padded[:-2, 1:-1].astype(int) + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]
    return float(counts[mask.reshape(grid, grid)].mean())


@pytest.mark.parametrize(("grid", "count", "min_block"), [(14, 80, 16), (7, 20, 4)])
def test_block_masks_never_exceed_the_count_and_come_in_blocks(grid: int, count: int, min_block: int) -> None:
    generator = BlockMaskGenerator(grid, count)
    assert generator.min_block == min_block  # BEiT's 16 patches per 196, scaled to the grid
    rng = np.random.default_rng(0)
    masks = [generator(rng) for _ in range(300)]
    counts = np.array([m.sum() for m in masks])
    assert counts.max() == count and counts.mean() >= 0.95 * count  # BEiT stops short when no block fits
    blockiness = np.mean([_masked_neighbours(m, grid) for m in masks])
    random_masks = [np.random.default_rng(i).permutation(grid * grid) < count for i in range(300)]
    assert blockiness > 2.5 > 2.0 > np.mean([_masked_neighbours(m, grid) for m in random_masks])


# ----- MAE loss ---------------------------------------------------------------------------------------
def test_norm_pix_loss_by_hand() -> None:
    """One image, two patches of 4 values; only patch 0 is masked. Target [1, 2, 3, 4]: mean 2.5, unbiased
    variance 5/3, so with pred 0 the loss is mean(((t - 2.5) / sqrt(5/3 + 1e-6))^2) = (5 / (5/3 + 1e-6)) / 4."""
    target = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [9.0, 9.0, 7.0, 7.0]]], dtype=torch.float64)
    pred = torch.zeros_like(target)
    masked = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    expected = 5.0 / (5.0 / 3.0 + 1e-6) / 4.0
    assert masked_patch_loss(pred, target, masked, norm_pix=True).item() == pytest.approx(expected, rel=1e-12)
    assert masked_patch_loss(pred, target, masked, norm_pix=False).item() == pytest.approx(30.0 / 4.0, rel=1e-12)


def test_mae_loss_covers_masked_patches_only() -> None:
    torch.manual_seed(0)
    pred, target = torch.randn(2, 5, 12, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    masked = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.float64)
    loss = masked_patch_loss(pred, target, masked, norm_pix=True)
    changed_visible = pred.clone()
    changed_visible[masked == 0] += 100.0
    assert masked_patch_loss(changed_visible, target, masked, norm_pix=True).item() == pytest.approx(loss.item(), rel=1e-12)
    changed_masked = pred.clone()
    changed_masked[0, 0] += 1.0
    assert masked_patch_loss(changed_masked, target, masked, norm_pix=True).item() != pytest.approx(loss.item())


def test_patchify_follows_the_patch_token_order() -> None:
    """Token j of the ViT's patch embedding is a linear map of patchify's row j, so targets line up with tokens."""
    torch.manual_seed(0)
    embed = PatchEmbed(img_size=28, patch_size=4, in_chans=3, embed_dim=5).double()
    images = torch.randn(2, 3, 28, 28, dtype=torch.float64)
    weight = embed.proj.weight.permute(0, 2, 3, 1).reshape(5, -1)  # (D, p, p, C) like patchify's rows
    expected = patchify(images, 4) @ weight.T + embed.proj.bias
    torch.testing.assert_close(embed(images), expected)


def test_mae_pretraining_trains_encoder_and_decoder_but_not_head_or_positions() -> None:
    torch.manual_seed(0)
    network = build_fed_mae(MODEL, 3, 3, 28, None, FedMaeConfig())
    network.train_only("pretrain")
    network.pretext_loss(torch.randn(4, 3, 28, 28)).backward()
    grads = {name: p.grad for name, p in network.named_parameters()}
    assert all(grads[k] is not None and grads[k].abs().sum() > 0
               for k in ("backbone.blocks.0.attn.qkv.weight", "decoder.pred.weight"))  # trained, not just attached
    assert all(grads[k] is None for k in ("head.weight", "backbone.fc_norm.weight", "backbone.pos_embed"))


# ----- schedules ------------------------------------------------------------------------------------
def _mae_pretrain_config() -> TrainConfig:
    from medflare.site_config import resolve_train_config

    return resolve_train_config(FED_MAE, {"batch_size": 64}).for_stage("pretrain")


@pytest.mark.parametrize(("stage_round", "step"), [(0, 0), (0, 2), (1, 0), (2, 3), (3, 3)])
def test_pretraining_lr_at_each_step_is_the_warmup_cosine_formula(stage_round: int, step: int) -> None:
    """MAE: blr 2e-3 x 64 / 256 = 5e-4 peak, one warm-up round then cosine to 0 over 4 rounds of 4 steps.
    Every parameter group gets the value of the step (never of its group index: spec §4(e)1)."""
    cfg = _mae_pretrain_config()
    assert (cfg.betas, cfg.base_batch, cfg.lr, cfg.min_lr) == ((0.9, 0.95), 256, 2e-3, 0.0)
    t = stage_round + step / 4
    peak = 2e-3 * 64 / 256
    expected = peak * t if t < 1 else 0.5 * peak * (1 + math.cos(math.pi * (t - 1) / 3))
    groups = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    optimizer = torch.optim.AdamW([{"params": [p], "lr_scale": 1.0} for p in groups])
    set_step_lr(optimizer, cfg, stage_round, 4, step, 4)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected] * 3, rel=1e-12, abs=1e-18)
    assert lr_at(cfg, t, 4) == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_trainer_lr_moves_with_the_step_in_pretraining_and_restarts_at_finetuning() -> None:
    site = _site("fed-mae", method_args={"pretrain_rounds": 2})
    seen = []
    site.trainer.after_step = lambda: seen.append(site.trainer.optimizer.param_groups[-1]["lr"])
    params = _global("fed-mae", {"pretrain_rounds": 2})
    optimizers = []
    for r, (stage, sr, n) in enumerate([("pretrain", 0, 2), ("pretrain", 1, 2), ("finetune", 0, 1)]):
        ctx = RoundContext(r, 3, stage=stage, stage_round=sr, stage_rounds=n, scored=stage == "finetune")
        site.train({k: params[k] for k in site.spec.payload.shared_keys(list(params), stage)}, ctx)
        optimizers.append(site.trainer.optimizer)
    assert seen[0] == 0.0 and seen[1] == pytest.approx(2e-3 * 8 / 256)  # warm-up from 0, then the peak at t = 1
    assert seen[2] == 0.0  # fine-tuning's own warm-up restarts from 0
    assert optimizers[0] is optimizers[1] and optimizers[1].state  # AdamW moments kept across pre-training rounds
    assert optimizers[2] is not optimizers[1]  # a new optimizer for the fine-tuning stage


# ----- stages -----------------------------------------------------------------------------------------
def test_stage_plans_add_up_and_name_the_options_when_they_do_not() -> None:
    assert FedMaeConfig(pretrain_rounds=3).stage_plan(5) == [Stage("pretrain", 3, False), Stage("finetune", 2)]
    assert FedMaeConfig(pretrain_rounds=0).stage_plan(4) == [Stage("finetune", 4)]  # the scratch baseline
    assert FedMaeConfig(pretrain_rounds=4, finetune_rounds=0).stage_plan(4) == [Stage("pretrain", 4, False)]
    beit = FedBeitConfig(tokenizer_rounds=1, pretrain_rounds=2).stage_plan(5)
    assert [(s.name, s.rounds, s.scored) for s in beit] == [("tokenizer", 1, False), ("pretrain", 2, False), ("finetune", 2, True)]
    with pytest.raises(ConfigError, match="leave none for fine-tuning"):
        FedMaeConfig(pretrain_rounds=3).stage_plan(3)
    with pytest.raises(ConfigError, match="rounds=5"):  # explicit budgets that do not add up: refused before launch
        RoundAggregation(get_method("fed-mae"), {"pretrain_rounds": 2, "finetune_rounds": 2}, 3, 5)


def test_a_job_that_names_no_model_gets_a_vit_and_a_stage_plan_that_fits_two_rounds() -> None:
    """``medflare run fed-mae --rounds 2 --set train.max_steps=1``: the method's default_model (not fedavg's cnn,
    the RunConfig defaults' own method), and default budgets of 1 pre-training + 1 fine-tuning round."""
    from medflare.console.cli import make_parser
    from medflare.console.run_options import build_run_config

    parser = make_parser()
    for method, rounds in (("fed-mae", 2), ("fed-beit", 3)):
        args = parser.parse_args(["run", method, "--rounds", str(rounds), "--set", "train.max_steps=1"])
        run = build_run_config(args)
        assert run.model == "vit_tiny", method
        spec = FED_MAE if method == "fed-mae" else FED_BEIT
        stages = spec.config_cls(**run.method_args).stage_plan(run.rounds)
        assert [(s.name, s.rounds) for s in stages][-2:] == [("pretrain", 1), ("finetune", 1)]
    chosen = parser.parse_args(["run", "fed-mae", "--model", "vit_micro"])
    assert build_run_config(chosen).model == "vit_micro"
    assert build_run_config(parser.parse_args(["run", "fedavg"])).model == "cnn"


def test_beit_tokenizer_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="tokenizer_rounds=0"):
        FedBeitConfig(tokenizer="dall-e:/x.pt", tokenizer_rounds=1)
    with pytest.raises(ConfigError, match="tokenizer must be"):
        FedBeitConfig(tokenizer="vqgan")
    assert FedBeitConfig(tokenizer="dall-e:/x.pt", tokenizer_rounds=0).dalle_path == "/x.pt"
    temperatures = [FedBeitConfig().temperature(r, 5) for r in range(5)]
    assert temperatures[0] == 1.0 and temperatures[-1] == pytest.approx(1 / 16) and temperatures == sorted(temperatures, reverse=True)


def _update(site: str, images: int, labelled: int) -> SiteUpdate:
    return SiteUpdate(site, {}, {N_IMAGES: images, contracts.N_SAMPLES: labelled})


def test_pretraining_weighs_sites_by_all_images_and_finetuning_by_labels() -> None:
    rule = SslFlRule(FedMaeConfig(pretrain_rounds=1), 2, FED_MAE.payload)
    updates = [_update("site-1", 100, 10), _update("site-2", 300, 90)]
    pretrain, finetune = RoundContext(0, 2, stage="pretrain"), RoundContext(1, 2, stage="finetune")
    assert rule.shares(updates, pretrain) == pytest.approx({"site-1": 0.25, "site-2": 0.75})
    assert rule.shares(updates, finetune) == pytest.approx({"site-1": 0.1, "site-2": 0.9})
    with pytest.raises(PayloadError, match="fewer than"):
        rule.site_weight(_update("site-3", 5, 10), pretrain)
    with pytest.raises(PayloadError, match=N_IMAGES):
        rule.site_weight(SiteUpdate("site-4", {}, {contracts.N_SAMPLES: 3}), pretrain)


def test_stage_handoff_carries_the_encoder_bit_identically_and_drops_the_decoder() -> None:
    """Through the server's own round code: the last pre-training aggregate's encoder is exactly what the first
    fine-tuning task carries and what a site's model then holds; decoder keys travel in neither direction."""
    args = {"pretrain_rounds": 1}
    core = RoundAggregation(get_method("fed-mae"), args, TASK.num_classes, 2)
    sites = [_site("fed-mae", i, args) for i in range(2)]
    global_params = _global("fed-mae", args)
    for ctx in (RoundContext(0, 2, "pretrain", stage_round=0, stage_rounds=1, scored=False),):
        core.start_round(global_params, ctx)
        task = core.start_phase(contracts.TRAIN_PHASE)
        assert any(k.startswith("decoder.") for k in task) and not any(k.startswith("head.") for k in task)
        for site in sites:
            arrays, meta = site.train(task, ctx)
            assert core.accept(site.site_name, arrays, meta) is None
        aggregate = core.aggregate().params
    finetune = RoundContext(1, 2, "finetune", stage_round=0, stage_rounds=1)
    core.start_round(aggregate, finetune)
    task = core.start_phase(contracts.TRAIN_PHASE)
    assert not any(k.startswith("decoder.") for k in task) and not any(k.startswith("decoder.") for k in core.expected)
    encoder = [k for k in aggregate if k.startswith("backbone.")]
    assert encoder and all(np.array_equal(task[k], aggregate[k]) and task[k].dtype == aggregate[k].dtype for k in encoder)
    site = sites[0]
    site.trainer.receive(task)
    held = site.model.state_dict()
    assert all(torch.equal(held[k], torch.from_numpy(aggregate[k])) for k in encoder)
    arrays, _ = site.train(task, finetune)
    assert set(arrays) == set(core.expected) and not any(k.startswith("decoder.") for k in arrays)


@pytest.mark.parametrize(
    ("method", "method_args", "other_stage_key"),
    [
        ("fed-mae", {"pretrain_rounds": 1}, {"pretrain": "head.weight", "finetune": "decoder.pred.weight"}),
        ("fed-beit", {"tokenizer_rounds": 1, "pretrain_rounds": 1, "min_code_perplexity": 0.0},  # a 1-step tokenizer
         {"tokenizer": "backbone.pos_embed", "pretrain": "tokenizer.decoder.0.weight", "finetune": "lm_head.proj.weight"}),
    ],
)
def test_the_site_privacy_filter_passes_every_stage_because_sites_send_back_only_what_they_received(
    method: str, method_args: dict, other_stage_key: dict[str, str], tmp_path: Path
) -> None:
    """Each round of the job, through the server's own round code and a real trainer: the result's weights are
    exactly the task's (so PayloadGuard, which refuses arrays the server never sent, lets them out), and a
    weight of another stage slipped into the result is refused by it."""
    from nvflare.apis.dxo import DXO, DataKind

    from medflare.deploy.filters import PayloadGuard
    from medflare.server_setup import round_plan

    from ..deploy.test_provision_and_policies import guard_context

    core = RoundAggregation(get_method(method), method_args, TASK.num_classes, len(other_stage_key))
    site = _site(method, 0, method_args)
    global_params = _global(method, method_args)
    for ctx in round_plan(core.stages, len(other_stage_key)):
        core.start_round(global_params, ctx)
        task = core.start_phase(contracts.TRAIN_PHASE)
        arrays, meta = site.train(task, ctx)
        assert set(arrays) == set(task), f"{ctx.stage}: sent {sorted(set(arrays) ^ set(task))[:3]} it did not receive"
        guard_ctx = guard_context(tmp_path / ctx.stage, method, task)
        result = DXO(DataKind.WEIGHTS, data=arrays, meta=meta).to_shareable()
        assert PayloadGuard(method).process(result, guard_ctx) is result
        extra = other_stage_key[ctx.stage]
        assert extra not in task and extra in site.model.state_dict()
        smuggled = {**arrays, extra: site.model.state_dict()[extra].numpy()}
        with pytest.raises(PayloadError, match="never sent"):
            PayloadGuard(method).process(DXO(DataKind.WEIGHTS, data=smuggled, meta=meta).to_shareable(), guard_ctx)
        assert core.accept(site.site_name, arrays, meta) is None
        global_params = {**global_params, **core.aggregate().params}


def test_each_stage_trains_only_its_modules_with_its_own_optimizer_settings() -> None:
    args = {"pretrain_rounds": 1}
    site = _site("fed-mae", 0, args, max_steps=2)  # the first step of a warm-up has lr 0
    params = _global("fed-mae", args)
    before = {k: v.clone() for k, v in site.model.state_dict().items()}
    pretrain = RoundContext(0, 2, "pretrain", stage_round=0, stage_rounds=1, scored=False)
    site.train({k: params[k] for k in FED_MAE.payload.shared_keys(list(params), "pretrain")}, pretrain)
    after = site.model.state_dict()
    assert torch.equal(after["head.weight"], before["head.weight"]) and torch.equal(after["backbone.pos_embed"], torch.from_numpy(params["backbone.pos_embed"]))
    assert not torch.equal(after["decoder.pred.weight"], torch.from_numpy(params["decoder.pred.weight"]))
    assert site.trainer.optimizer.defaults["betas"] == (0.9, 0.95) and len(site.trainer.optimizer.param_groups) == 2
    decoder = after["decoder.pred.weight"].clone()
    finetune = RoundContext(1, 2, "finetune", stage_round=0, stage_rounds=1)
    site.train({k: params[k] for k in FED_MAE.payload.shared_keys(list(params), "finetune")}, finetune)
    assert torch.equal(site.model.state_dict()["decoder.pred.weight"], decoder)  # frozen after pre-training
    assert site.trainer.optimizer.defaults["betas"] == (0.9, 0.999)
    assert len({g["lr_scale"] for g in site.trainer.optimizer.param_groups}) == 8  # layer decay: stem, 6 blocks, head


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_a_restarted_site_rebuilds_the_optimizer_of_its_stage(stage: str, tmp_path: Path) -> None:
    settings = dict(spec=FED_MAE, task=TASK, data=DATA, model=MODEL, train=QUICK, evaluation="off")
    site = SiteRuntime(SiteSettings(**settings), "site-1", 0, log=lambda m: None, local_dir=tmp_path)
    params = _global("fed-mae", {})
    ctx = RoundContext(1, 3, stage, stage_round=0, stage_rounds=1, scored=stage == "finetune")
    site.train({k: params[k] for k in FED_MAE.payload.shared_keys(list(params), stage)}, ctx)
    site.close()  # its state is written in the background: on disk before the site "restarts"
    restarted = SiteRuntime(SiteSettings(**settings), "site-1", 0, log=lambda m: None, local_dir=tmp_path)
    assert restarted.trainer.train_cfg == site.trainer.train_cfg  # the stage's settings, not the job's flat ones
    assert restarted.trainer.optimizer.defaults["betas"] == site.trainer.optimizer.defaults["betas"]
    assert len(restarted.trainer.optimizer.param_groups) == len(site.trainer.optimizer.param_groups)
    assert restarted.model.decoder.pred.weight.requires_grad == (stage == "pretrain")


def test_finetuning_uses_the_labelled_images_and_pretraining_all_of_them() -> None:
    site = _site("fed-mae", 0, {"pretrain_rounds": 1}, data={"label_fraction": 0.3})
    labelled = int((site.data.train.labels >= 0).sum())
    assert 0 < labelled < len(site.data.train)
    site.trainer._stage = "pretrain"
    assert len(site.trainer.train_dataset()) == len(site.data.train)
    site.trainer._stage = "finetune"
    assert len(site.trainer.train_dataset()) == labelled
    meta = site.trainer.round_meta(RoundContext(0, 2, "pretrain"))
    assert meta == {N_IMAGES: len(site.data.train)} and int(site.trainer.class_counts.sum()) == labelled


def test_finetune_loss_is_label_smoothed_and_mixup_pairs_the_batch_with_its_reverse() -> None:
    site = _site("fed-mae", 0, {"mixup": 0.0, "cutmix": 0.0})
    site.model.eval()  # no stochastic depth, so the loss can be recomputed
    torch.manual_seed(0)
    images, labels = torch.randn(5, 3, 28, 28), torch.tensor([0, 1, 2, 0, 1])
    plain = site.trainer.finetune_loss(images, labels)
    assert plain.item() == pytest.approx(F.cross_entropy(site.model(images), labels, label_smoothing=0.1).item(), rel=1e-6)
    mixing = _site("fed-mae", 0, {"mixup": 0.8, "cutmix": 0.0})
    mixing.model.eval()
    np.random.seed(0)
    loss = mixing.trainer.finetune_loss(images.clone(), labels)  # odd batch: the last sample is left out
    np.random.seed(0)
    np.random.rand()  # timm draws whether to mix (always, prob 1) before lambda
    lam = float(np.random.beta(0.8, 0.8))
    mixed = lam * images[:4] + (1 - lam) * images[:4].flip(0)
    smooth = F.one_hot(labels[:4], 3).double() * 0.9 + 0.1 / 3
    targets = lam * smooth + (1 - lam) * smooth.flip(0)
    expected = -(targets * F.log_softmax(mixing.model(mixed).double(), dim=1)).sum(1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


# ----- Fed-BEiT ---------------------------------------------------------------------------------------
def test_dvae_gives_one_token_per_patch_and_learns() -> None:
    torch.manual_seed(0)
    vae = DiscreteVae(channels=1, patch=4, vocab=16, hidden=32, code_dim=16)
    images = F.interpolate(torch.randint(0, 4, (32, 1, 7, 7)) * 2 / 3 - 1, size=28)  # 4 grey levels, one per patch
    tokens = vae.tokens(images)
    assert tokens.shape == (32, 49) and tokens.dtype == torch.int64 and 0 <= tokens.min() and tokens.max() < 16
    loss, codes = vae.loss_and_codes(images)
    assert torch.equal(codes, tokens)  # the codes the tokenizer stage counts are the tokens it will give
    optimizer = torch.optim.Adam(vae.parameters(), 3e-3)
    losses = []
    for _ in range(60):
        loss = vae.loss(images, kl_weight=0.01)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_token_j_is_the_code_of_vit_patch_j_row_by_row(tmp_path: Path) -> None:
    """Token j of each tokenizer is the code its encoder gives at grid cell (j // grid, j % grid): the region of ViT
    patch j, since patchify and timm's PatchEmbed also run row by row (test above). A transposed token grid would ask
    the ViT to predict, at patch (r, c), the code of patch (c, r), and every other test would still pass."""
    torch.manual_seed(0)
    file = tmp_path / "dalle_encoder.pt"
    torch.save(DalleEncoder(hidden=16, vocab=32).state_dict(), file)
    vae = DiscreteVae(channels=1, patch=4, vocab=16, hidden=8, code_dim=4)
    images = torch.randn(3, 1, 28, 28)
    dalle = DalleTokenizer(file, grid=7)
    for encoder, tokenize in ((vae.encoder, vae.tokens), (vae.encoder, lambda x: vae.loss_and_codes(x)[1]),
                              (dalle.encoder, dalle.tokens)):
        seen: list[torch.Tensor] = []
        hook = encoder.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out.detach().argmax(dim=1)))
        tokens = tokenize(images)
        hook.remove()
        [by_cell] = seen  # [B, 7, 7]: the code at each grid cell
        assert by_cell.shape == (3, 7, 7) and not torch.equal(by_cell, by_cell.transpose(1, 2))
        assert [tokens[b, 7 * r + c] for b, r, c in [(0, 1, 5), (2, 6, 0)]] == [by_cell[0, 1, 5], by_cell[2, 6, 0]]
        assert torch.equal(tokens, by_cell.reshape(3, 49))


def _textured_images(count: int, generator: torch.Generator) -> torch.Tensor:
    """Grey 28-px images of smooth random blobs plus patch-level texture (no two patches alike)."""
    coarse = F.interpolate(torch.rand(count, 1, 4, 4, generator=generator), size=28, mode="bilinear", align_corners=False)
    fine = F.interpolate(torch.rand(count, 1, 14, 14, generator=generator), size=28, mode="nearest")
    return (0.7 * coarse + 0.3 * fine) * 2 - 1


def test_a_short_tokenizer_stage_uses_a_healthy_share_of_the_codebook() -> None:
    """Fed-BEiT's default dVAE (512 codes) after a short stage, 2 rounds x 10 steps x 32 images at 4-px patches
    with the stage's lr and temperature schedule: its tokens of held images spread over the codebook, above the
    default floor. (Before the fix: a handful of codes carried every patch, perplexity < 5.)"""
    cfg = FedBeitConfig()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    vae = DiscreteVae(1, 4, cfg.vocab_size, cfg.dvae_hidden, cfg.dvae_code_dim)
    optimizer = torch.optim.AdamW(vae.parameters(), 1e-3, weight_decay=0.0)  # train.stages.tokenizer
    for stage_round in range(2):
        vae.temperature = cfg.temperature(stage_round, 2)
        for _ in range(10):
            loss = vae.loss(_textured_images(32, generator), cfg.dvae_kl_weight, cfg.dvae_usage_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    used, perplexity = code_usage(torch.bincount(vae.tokens(_textured_images(256, generator)).flatten(), minlength=512))
    assert perplexity >= cfg.min_code_perplexity and used >= 64


def test_code_statistics_reach_the_round_record_and_a_collapsed_tokenizer_fails_loudly() -> None:
    """Sites report codes used and perplexity in the tokenizer and pre-training stages; the round record keeps them
    per site with their image-weighted mean, and a pre-training mean below min_code_perplexity stops the job."""
    def update(site: str, images: int, used: int, perplexity: float) -> SiteUpdate:
        return SiteUpdate(site, {}, {N_IMAGES: images, contracts.N_SAMPLES: images, "codes_used": used,
                                     "code_perplexity": perplexity})

    rule = SslFlRule(FedBeitConfig(), 4, FED_BEIT.payload)
    updates = [update("site-1", 100, 40, 10.0), update("site-2", 300, 200, 50.0)]
    pretrain = RoundContext(2, 4, stage="pretrain", stage_round=0, stage_rounds=1, scored=False)
    tokenizer = RoundContext(0, 4, stage="tokenizer", stage_round=0, stage_rounds=2, scored=False)
    info = rule.round_info(updates, pretrain)
    assert info["code_perplexity"] == {"site-1": 10.0, "site-2": 50.0} and info["codes_used"]["site-2"] == 200
    assert info["code_perplexity_mean"] == pytest.approx(0.25 * 10 + 0.75 * 50)
    low = [update("site-1", 100, 9, 3.0), update("site-2", 300, 12, 5.0)]
    assert rule.round_info(low, tokenizer)["code_perplexity_mean"] == pytest.approx(4.5)  # still training: no check
    with pytest.raises(ConfigError, match=r"perplexity 4.50 .* below method.min_code_perplexity=16"):
        rule.round_info(low, pretrain)
    assert SslFlRule(FedBeitConfig(min_code_perplexity=0), 4, FED_BEIT.payload).round_info(low, pretrain)
    assert SslFlRule(FedMaeConfig(), 2, FED_MAE.payload).round_info([_update("site-1", 5, 5)], pretrain) == {}
    site = _site("fed-beit", 0, {"min_code_perplexity": 0.0})
    params = _global("fed-beit")
    for ctx in (tokenizer, pretrain):
        _, meta = site.train({k: params[k] for k in FED_BEIT.payload.shared_keys(list(params), ctx.stage)}, ctx)
        assert int(site.trainer.code_counts.sum()) == QUICK["batch_size"] * 49  # every token of the round's batch
        assert 1 <= meta["codes_used"] <= 512 and 1.0 <= meta["code_perplexity"] <= meta["codes_used"]
        assert FED_BEIT.payload.meta["code_perplexity"](meta["code_perplexity"], None) == meta["code_perplexity"]


BEIT_QUICK_ARGS = {"tokenizer_rounds": 1, "pretrain_rounds": 1, "min_code_perplexity": 0.0}


@pytest.mark.parametrize(("used", "perplexity", "refused"), [
    (10, 1e8, "'code_perplexity' is 1e+08, outside 1..10"),  # issue 60: accepted with a 512-code book
    (512, 600.0, "'code_perplexity' is 600, outside 1..512"),
    (10, 0.5, "'code_perplexity' is 0.5, outside 1..10"),
    (600, 100.0, "'codes_used' is 600, not a whole number of codes in 1..512 (method.vocab_size)"),
    (0, 1.0, "'codes_used' is 0, not a whole number of codes in 1..512"),
    (10.5, 5.0, "'codes_used' is 10.5, not a whole number"),
])
def test_a_sites_code_statistics_are_bounded_by_the_codebook(used: float, perplexity: float, refused: str) -> None:
    """Issue 60, item 4: the server's own round code refuses code statistics no histogram over the job's 512 codes
    can have (perplexity is exp of an entropy: 1 <= perplexity <= codes used <= codebook)."""
    core = RoundAggregation(get_method("fed-beit"), BEIT_QUICK_ARGS, TASK.num_classes, 3)
    pretrain = RoundContext(1, 3, stage="pretrain", stage_round=0, stage_rounds=1, scored=False)
    core.start_round(_global("fed-beit", BEIT_QUICK_ARGS), pretrain)
    task = core.start_phase(contracts.TRAIN_PHASE)
    meta = {contracts.N_SAMPLES: 10, N_IMAGES: 10, "codes_used": used, "code_perplexity": perplexity}
    reason = core.accept("site-1", dict(task), meta)
    assert reason is not None and refused in reason and "\n" not in reason
    uniform = {**meta, "codes_used": 512, "code_perplexity": 512 * (1 + 1e-13)}  # a uniform histogram, rounded
    assert core.accept("site-2", dict(task), uniform) is None
    alone = {key: value for key, value in uniform.items() if key != "codes_used"}
    assert "'code_perplexity' without its pair" in core.accept("site-3", dict(task), alone)


def test_norm_pix_loss_defaults_off_at_small_patches_and_on_at_mae_patches() -> None:
    """auto: off at 4-px patches (28 px images; with it on Fed-MAE's features collapsed there), on at 16 px."""
    assert FedMaeConfig().norm_pix_loss == "auto"
    assert not FedMaeConfig().norm_pix(4) and not FedMaeConfig().norm_pix(8) and FedMaeConfig().norm_pix(16)
    assert FedMaeConfig(norm_pix_loss=True).norm_pix(4) and not FedMaeConfig(norm_pix_loss=False).norm_pix(16)
    assert build_fed_mae(MODEL, 2, 1, 28, None, FedMaeConfig()).norm_pix is False
    assert build_fed_mae(MODEL, 2, 1, 224, None, FedMaeConfig()).norm_pix is True  # 14 x 14 patches of 16 px
    with pytest.raises(ConfigError, match="norm_pix_loss must be"):
        FedMaeConfig(norm_pix_loss="sometimes")


def test_beit_pretraining_predicts_tokens_of_masked_patches_only() -> None:
    torch.manual_seed(0)
    network = build_fed_beit(MODEL, 3, 3, 28, None, FedBeitConfig()).eval()
    images = torch.randn(2, 3, 28, 28)
    tokens = network.tokenizer.tokens(images)
    masked = BlockMaskGenerator(7, 20).batch(2, np.random.default_rng(0))
    loss = network.pretext_loss(images, tokens, masked)
    changed = tokens.clone()
    changed[~masked] = (changed[~masked] + 1) % 512  # visible patches' tokens are not targets
    assert network.pretext_loss(images, changed, masked).item() == pytest.approx(loss.item(), rel=1e-6)
    changed[masked] = (changed[masked] + 1) % 512
    assert network.pretext_loss(images, changed, masked).item() != pytest.approx(loss.item())


def test_beit_payload_moves_the_tokenizer_then_the_encoder() -> None:
    keys = list(_global("fed-beit"))
    payload = FED_BEIT.payload
    assert all(k.startswith("tokenizer.") for k in payload.shared_keys(keys, "tokenizer"))
    pretrain = payload.shared_keys(keys, "pretrain")
    assert {"lm_head.proj.weight", "tokenizer.encoder.0.weight"} <= set(pretrain)
    assert not any(k.startswith(("head.", "tokenizer.decoder.", "tokenizer.codebook.")) for k in pretrain)
    assert not any(k.startswith(("lm_head.", "tokenizer.")) for k in payload.shared_keys(keys, "finetune"))


def test_dalle_encoder_has_the_published_layout_and_loads_from_a_local_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    small = DalleEncoder(hidden=64, vocab=512)
    keys = set(small.state_dict())
    assert {"blocks.input.w", "blocks.group_1.block_1.res_path.conv_1.w", "blocks.group_2.block_1.id_path.w",
            "blocks.group_4.block_2.res_path.conv_4.b", "blocks.output.conv.w"} <= keys
    assert "blocks.group_1.block_1.id_path.w" not in keys  # same width: identity path
    file = tmp_path / "dalle_encoder.pt"
    torch.save(small.state_dict(), file)
    loaded = load_dalle_encoder(file)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in small.state_dict().items())
    tokens = DalleTokenizer(file, grid=7).tokens(torch.rand(2, 1, 28, 28) * 2 - 1)
    assert tokens.shape == (2, 49) and tokens.max() < 512  # 56 px in, one code per ViT patch out
    torch.save({"blocks.input.w": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(DataError, match="not a DALL-E encoder"):
        load_dalle_encoder(tmp_path / "other.pt")


def test_beit_refuses_a_dalle_file_whose_vocabulary_differs(tmp_path: Path) -> None:
    file = tmp_path / "dalle_encoder.pt"
    torch.save(DalleEncoder(hidden=64, vocab=512).state_dict(), file)
    args = {"tokenizer": f"dall-e:{file}", "tokenizer_rounds": 0, "vocab_size": 8192}
    with pytest.raises(ConfigError, match="vocab_size=512"):
        _site("fed-beit", 0, args)
    site = _site("fed-beit", 0, {**args, "vocab_size": 512})
    assert site.trainer.dalle is not None and not any(k.startswith("tokenizer.") for k in site.model.state_dict())


# ----- encoder export, chaining and Fed-MAS ---------------------------------------------------------------
def test_exported_encoder_rebuilds_bit_identically_and_chains_into_a_new_job(tmp_path: Path) -> None:
    torch.manual_seed(0)
    network = build_fed_mae(MODEL, 3, 1, 28, None, FedMaeConfig()).eval()
    with torch.no_grad():  # a trained final norm, unlike the untrained fc_norm
        network.decoder.encoder_norm.weight.uniform_(0.5, 2.0)
        network.decoder.encoder_norm.bias.uniform_(-0.5, 0.5)
    path = save_encoder(network, tmp_path / "encoder.pt", "fed-mae", MODEL)
    content = torch.load(path, weights_only=True)
    assert content["format"] == "medflare.ssl_fl.encoder/2" and all(k.startswith("backbone.") for k in content["state_dict"])
    assert all(torch.equal(content["encoder_norm"][k], v) for k, v in network.decoder.encoder_norm.state_dict().items())
    encoder, info = load_encoder(path)
    images = torch.randn(3, 1, 28, 28)
    assert (info.in_channels, info.image_size, info.num_features) == (1, 28, 96)
    pooled = network.decoder.encoder_norm(network.backbone.forward_features(images))[:, 1:].mean(1)
    assert torch.equal(encoder(images), pooled)
    assert torch.equal(encoder(images.expand(-1, 3, -1, -1)), pooled)  # RGB copy of grey
    chained = build_fed_mae(MODEL, 3, 1, 28, str(path), FedMaeConfig(pretrain_rounds=0))
    assert all(torch.equal(chained.state_dict()[k], v) for k, v in content["state_dict"].items())
    with pytest.raises(DataError, match="not an SSL-FL encoder"):
        torch.save({"state_dict": {}}, tmp_path / "plain.pt")
        load_encoder(tmp_path / "plain.pt")
    torch.save({**content, "format": "medflare.ssl_fl.encoder/1"}, tmp_path / "old.pt")
    with pytest.raises(DataError, match="dropped the trained encoder norm; export it again"):
        load_encoder(tmp_path / "old.pt")


def test_export_from_a_run_needs_a_pretraining_only_run(tmp_path: Path) -> None:
    args = {"pretrain_rounds": 2, "finetune_rounds": 0}
    network = build_global_model("fed-mae", MODEL, 3, 3, 28, method_args=args)
    torch.save({"model": network.state_dict()}, tmp_path / "FL_global_model.pt")
    config = {"method": "fed-mae", "model": MODEL, "rounds": 2, "method_args": args, "task": vars(TASK)}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config}))
    encoder, _ = load_encoder(export_run(tmp_path))
    assert torch.equal(encoder.network.backbone.pos_embed, network.state_dict()["backbone.pos_embed"])
    config["method_args"] = {"pretrain_rounds": 1}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config}))
    with pytest.raises(ConfigError, match="fine-tuned"):
        export_run(tmp_path)


def test_fed_mas_runs_on_a_fed_mae_encoder_as_its_frozen_prior(tmp_path: Path) -> None:
    torch.manual_seed(0)
    network = build_fed_mae(MODEL, 2, 1, 28, None, FedMaeConfig()).eval()
    path = save_encoder(network, tmp_path / "encoder.pt", "fed-mae", MODEL)
    prior_spec = f"fed-mae:{path}"
    prior = build_prior(prior_spec, 96, input_size=64)  # the encoder's own size wins over prior_input_size
    images = torch.rand(2, 1, 28, 28) * 2 - 1
    torch.testing.assert_close(prior(images), network.decoder.encoder_norm(network.backbone.forward_features(images))[:, 1:].mean(1))
    settings = SiteSettings(
        spec=get_method("fedmas"), task=TaskSpec(2, 1, 28), data={"source": "synthetic:n=80,classes=2,channels=1", "num_sites": 1},
        model="cnn", method_args={"prior": prior_spec, "prior_dim": 96}, train=QUICK, evaluation="off",
    )
    site = SiteRuntime(settings, "site-1", 0, log=lambda m: None)
    params = {k: v.numpy() for k, v in build_global_model("fedmas", "cnn", 2, 1, 28, method_args=settings.method_args).state_dict().items()}
    _, meta = site.train(params, RoundContext(0, 1))
    assert 0 < meta["rf"] <= 1


def test_one_sites_image_count_cannot_decide_the_perplexity_gate_past_the_share_cap() -> None:
    """Issue 49, item 2: a site claiming 10^8 images and a collapsed perplexity weighs at most the job's cap."""
    def update(site: str, images: int, perplexity: float) -> SiteUpdate:
        return SiteUpdate(site, {}, {N_IMAGES: images, contracts.N_SAMPLES: images, "codes_used": 10,
                                     "code_perplexity": perplexity})

    pretrain = RoundContext(2, 4, stage="pretrain", stage_round=0, stage_rounds=1, scored=False)
    updates = [update("site-1", 100, 40.0), update("site-2", 100, 40.0), update("hostile", 10**8, 1.0)]
    rule = SslFlRule(FedBeitConfig(), 4, FED_BEIT.payload)
    with pytest.raises(ConfigError, match="below method.min_code_perplexity"):
        rule.round_info(updates, pretrain)  # without a cap (research runs) the count decides
    rule.share_cap = 0.6
    assert rule.round_info(updates, pretrain)["code_perplexity_mean"] == pytest.approx(0.6 * 1.0 + 0.4 * 40.0)
