"""SSL-FL's key invariants (methods/ssl_fl/ledger.toml): the rules that, broken, silently turn Fed-MAE or Fed-BEiT
into another method. Fast: ``vit_micro`` at 28 px (7 x 7 patches of 4 px), tiny synthetic data, no simulator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from medflare import contracts
from medflare.methods.base import MethodSpec, RoundContext
from medflare.methods.ssl_fl import FED_BEIT, FED_MAE, FedBeitConfig, FedMaeConfig, build_fed_beit, build_fed_mae
from medflare.methods.ssl_fl.client import N_IMAGES
from medflare.methods.ssl_fl.export import export_run, load_encoder
from medflare.methods.ssl_fl.masking import BlockMaskGenerator, random_mask
from medflare.methods.ssl_fl.model import patchify
from medflare.plan import build_global_model
from medflare.registry import get_method
from medflare.server_round import RoundAggregation
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

MODEL = "vit_micro"  # 96-d, depth 6: 7 x 7 patches of 4 px at 28 px
GRID, PATCH, DEPTH = 7, 4, 6
TASK = TaskSpec(num_classes=3, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=120,classes=3", "num_sites": 2, "partition": "iid"}
QUICK = {"max_steps": 1, "batch_size": 8, "eval_batch_size": 64}
# method -> (method_args, the job's rounds, the pre-training round's context)
JOBS = {
    "fed-mae": ({"pretrain_rounds": 1}, 2, RoundContext(0, 2, "pretrain", stage_round=0, stage_rounds=1, scored=False)),
    "fed-beit": ({"tokenizer_rounds": 1, "pretrain_rounds": 1}, 3,
                 RoundContext(1, 3, "pretrain", stage_round=0, stage_rounds=1, scored=False)),
}


def _site(method: str, data: dict | None = None, **train: object) -> SiteRuntime:
    settings = SiteSettings(
        spec=get_method(method), task=TASK, data={**DATA, **(data or {})}, model=MODEL, method_args=JOBS[method][0],
        train={**QUICK, **train}, evaluation="off",
    )
    return SiteRuntime(settings, "site-1", 0, log=lambda message: None)


def _global(method: str, method_args: dict | None = None) -> dict[str, np.ndarray]:
    args = JOBS[method][0] if method_args is None else method_args
    network = build_global_model(method, MODEL, TASK.num_classes, TASK.in_channels, TASK.image_size, method_args=args)
    return {k: v.numpy() for k, v in network.state_dict().items()}


def _shifted(arrays: dict[str, np.ndarray], by: float) -> dict[str, np.ndarray]:
    """Every float array plus ``by`` (a site's update that is easy to average by hand)."""
    return {k: (v + by).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in arrays.items()}


def _encoder_keys(keys: list[str]) -> list[str]:
    """The encoder's keys that pre-training trains (fc_norm pools only in fine-tuning)."""
    return [k for k in keys if k.startswith("backbone.") and not k.startswith("backbone.fc_norm.")]


def _pixel_mask(patch_mask: torch.Tensor) -> torch.Tensor:
    """bool ``[B, N]`` patch mask -> ``[B, 1, H, W]`` pixel mask (patches row by row)."""
    grid = patch_mask.reshape(-1, 1, GRID, GRID)
    return grid.repeat_interleave(PATCH, dim=2).repeat_interleave(PATCH, dim=3)


# ----- 1. the encoder is FedAvg-ed in pre-training, by every image ----------------------------------------
@pytest.mark.parametrize("method", ["fed-mae", "fed-beit"])
def test_a_pretraining_round_averages_every_encoder_block_by_image_count(method: str) -> None:
    """Two sites shift every weight by 1 and by 5; with 100 and 300 images (10 and 90 labels) the pre-training
    aggregate is shifted by 0.25 * 1 + 0.75 * 5 = 4 on every encoder key (by labels it would be 4.6)."""
    args, rounds, ctx = JOBS[method]
    core = RoundAggregation(get_method(method), args, TASK.num_classes, rounds)
    global_params = _global(method)
    core.start_round(global_params, ctx)
    task = core.start_phase(contracts.TRAIN_PHASE)
    encoder = _encoder_keys(list(global_params))
    assert "backbone.blocks.0.attn.qkv.weight" in encoder and set(encoder) <= set(task)
    for site, images, labelled, shift in (("site-1", 100, 10, 1.0), ("site-2", 300, 90, 5.0)):
        meta = {contracts.N_SAMPLES: labelled, N_IMAGES: images}
        assert core.accept(site, _shifted(task, shift), meta) is None
    aggregate = core.aggregate().params
    for key in encoder:
        np.testing.assert_allclose(aggregate[key], global_params[key] + 4.0, rtol=0, atol=1e-5, err_msg=key)


# ----- 2. fine-tuning starts from the pre-trained encoder ---------------------------------------------------
@pytest.mark.parametrize("method", ["fed-mae", "fed-beit"])
def test_finetuning_starts_from_the_received_pretrained_encoder(method: str) -> None:
    """The encoder a site fine-tunes is the one it received (the pre-trained global one), not a fresh one: two
    warm-up steps of a tiny lr move it by far less than any re-initialisation would."""
    site = _site(method, max_steps=2)
    rng = np.random.default_rng(0)
    pretrained = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in _global(method).items()}
    task = {k: pretrained[k] for k in site.spec.payload.shared_keys(list(pretrained), "finetune")}
    rounds = JOBS[method][1]
    arrays, _ = site.train(task, RoundContext(rounds - 1, rounds, "finetune", stage_round=0, stage_rounds=1))
    encoder = _encoder_keys(list(task))
    assert "backbone.blocks.5.mlp.fc2.weight" in encoder
    moved = max(float(np.abs(np.asarray(arrays[k], np.float64) - task[k]).max()) for k in encoder)
    assert moved < 1e-2


# ----- 3. the export writes the trained encoder ---------------------------------------------------------------
def test_the_export_writes_the_trained_encoder_weights(tmp_path: Path) -> None:
    """Every exported encoder tensor is the run's saved global one, not the freshly built network's."""
    args = {"pretrain_rounds": 2, "finetune_rounds": 0}
    network = build_fed_mae(MODEL, 3, 3, 28, None, FedMaeConfig(**args))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in network.named_parameters():
            if name.startswith("backbone.") and name != "backbone.pos_embed":  # the sin-cos table stays fixed
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    trained = network.state_dict()
    torch.save({"model": trained}, tmp_path / "FL_global_model.pt")
    config = {"method": "fed-mae", "model": MODEL, "rounds": 2, "method_args": args, "task": vars(TASK)}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config}))
    encoder, _ = load_encoder(export_run(tmp_path))
    exported = encoder.network.state_dict()
    keys = _encoder_keys(list(trained))  # fc_norm pools only in fine-tuning: the prior pools the trained norm
    assert "backbone.blocks.0.attn.qkv.weight" in keys
    assert all(torch.equal(exported[k], trained[k]) for k in keys)
    assert all(torch.equal(exported[f"backbone.norm.{p}"], trained[f"decoder.encoder_norm.{p}"]) for p in ("weight", "bias"))
    images = torch.randn(2, 3, 28, 28)
    torch.testing.assert_close(encoder(images), _trained_features(network.eval(), images))


def _trained_features(network: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The trained network's encoder output as pre-training's head sees it (blocks, then the trained final norm),
    mean-pooled over the patch tokens."""
    with torch.no_grad():
        tokens = network.backbone.forward_features(images)  # the ViT's own norm is an identity (fc_norm pooling)
        norm = network.decoder.encoder_norm if hasattr(network, "decoder") else network.lm_head.norm
        return norm(tokens)[:, 1:].mean(dim=1)


@pytest.mark.parametrize("method", ["fed-mae", "fed-beit"])
def test_the_exported_prior_gives_the_trained_encoders_normalised_features(method: str, tmp_path: Path) -> None:
    """A few real pre-training steps (encoder and final norm move off their initialisation), export, load through
    Fed-MAS's prior loader: its features are the trained encoder's, through the norm pre-training trained."""
    from medflare.methods.fed_mas.prior import build_prior
    from medflare.methods.ssl_fl.export import export_global_model

    args, rounds, ctx = JOBS[method]
    args = {**args, "finetune_rounds": 0, "min_code_perplexity": 0.0} if method == "fed-beit" else {**args, "finetune_rounds": 0}
    site = _site(method, max_steps=3)
    site.trainer.cfg.min_code_perplexity = 0.0
    params = _global(method, args)
    with torch.no_grad():  # a trained norm far from LayerNorm's (1, 0) start, so dropping it shows
        for key in ("decoder.encoder_norm.weight", "lm_head.norm.weight"):
            if key in params:
                params[key] = (params[key] * 0 + np.linspace(0.2, 3.0, params[key].size)).astype(params[key].dtype)
    site.train({k: params[k] for k in site.spec.payload.shared_keys(list(params), ctx.stage)}, ctx)
    network = site.model.eval()
    initial = build_global_model(method, MODEL, TASK.num_classes, TASK.in_channels, TASK.image_size, method_args=args)
    assert not torch.equal(network.state_dict()["backbone.blocks.0.attn.qkv.weight"],
                           initial.state_dict()["backbone.blocks.0.attn.qkv.weight"])
    model_file = tmp_path / "FL_global_model.pt"
    torch.save({"model": network.state_dict()}, model_file)
    spec = FED_MAE if method == "fed-mae" else FED_BEIT
    fresh = spec.build_model(MODEL, TASK.num_classes, TASK.in_channels, TASK.image_size, None, spec.config_cls(**args))
    out = export_global_model(fresh, method, MODEL, model_file, tmp_path / "encoder.pt")
    prior = build_prior(f"fed-mae:{out}", 96, input_size=28)
    images = torch.rand(4, 3, 28, 28) * 2 - 1
    torch.testing.assert_close(prior(images), _trained_features(network, images), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(prior(images), network.forward_features(images), atol=1e-2)  # not fc_norm's pooling


# ----- 4. BEiT: the encoder sees the mask token, never the masked patches -------------------------------------
def test_beit_encoder_sees_the_mask_token_in_place_of_the_masked_patches() -> None:
    torch.manual_seed(0)
    network = build_fed_beit(MODEL, 3, 3, 28, None, FedBeitConfig()).eval()
    with torch.no_grad():
        network.lm_head.proj.weight.mul_(50.0)  # a confident token classifier: the loss follows the encoding
    images = torch.randn(2, 3, 28, 28)
    tokens = network.tokenizer.tokens(images)
    masked = BlockMaskGenerator(GRID, 20).batch(2, np.random.default_rng(0))
    loss = network.pretext_loss(images, tokens, masked).item()
    hidden = _pixel_mask(masked)
    other_masked = torch.where(hidden, torch.randn_like(images), images)
    assert abs(network.pretext_loss(other_masked, tokens, masked).item() - loss) < 1e-6
    other_visible = torch.where(hidden, images, torch.randn_like(images))
    assert abs(network.pretext_loss(other_visible, tokens, masked).item() - loss) > 1e-3  # the test can fail
    with torch.no_grad():
        network.lm_head.mask_token.add_(torch.randn_like(network.lm_head.mask_token))
    assert abs(network.pretext_loss(images, tokens, masked).item() - loss) > 1e-3


# ----- 5-7. MAE: the encoder sees int(N(1 - m)) patches; the loss scores the masked ones, norm_pix targets ----
def _mae_run(network: torch.nn.Module, images: torch.Tensor, seed: int) -> tuple[float, torch.Tensor, int]:
    """(loss, the decoder's predictions, tokens the encoder's blocks saw) of one seeded pre-training step."""
    seen: dict[str, object] = {}
    hooks = [network.backbone.blocks.register_forward_hook(lambda m, i, o: seen.update(width=i[0].shape[1])),
             network.decoder.register_forward_hook(lambda m, i, o: seen.update(pred=o.detach()))]
    torch.manual_seed(seed)
    loss = network.pretext_loss(images).item()
    for hook in hooks:
        hook.remove()
    return loss, seen["pred"], seen["width"]


def test_mae_encodes_the_visible_share_and_scores_masked_normalised_patches() -> None:
    """m = 0.6 of 49 patches: the encoder sees the class token and int(49 * 0.4) = 19 patches; the loss is the
    mean over the masked patches of the per-patch MSE to the patch standardised by its mean and unbiased var."""
    torch.manual_seed(0)
    network = build_fed_mae(MODEL, 3, 3, 28, None, FedMaeConfig(norm_pix_loss=True)).eval()
    images = torch.randn(3, 3, 28, 28)
    loss, pred, width = _mae_run(network, images, seed=1)
    assert width == 1 + 19
    torch.manual_seed(1)
    hidden = random_mask(3, GRID * GRID, 0.6).masked.bool()  # the mask the step drew
    target = patchify(images, PATCH).double()
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6).sqrt()
    per_patch = ((pred.double() - target) ** 2).mean(-1)
    assert hidden.sum().item() == 3 * 30
    assert loss == pytest.approx(per_patch[hidden].mean().item(), rel=1e-5)


def test_mae_encoder_never_sees_the_masked_patches() -> None:
    """Changing the pixels of the masked patches leaves every prediction unchanged (only the targets move)."""
    torch.manual_seed(0)
    network = build_fed_mae(MODEL, 3, 3, 28, None, FedMaeConfig()).eval()
    images = torch.randn(2, 3, 28, 28)
    loss, pred, _ = _mae_run(network, images, seed=1)
    torch.manual_seed(1)
    hidden = _pixel_mask(random_mask(2, GRID * GRID, 0.6).masked.bool())
    other = torch.where(hidden, torch.randn_like(images), images)
    other_loss, other_pred, _ = _mae_run(network, other, seed=1)
    torch.testing.assert_close(other_pred, pred)
    assert other_loss != pytest.approx(loss, rel=1e-3)


# ----- 8. BEiT: block-wise masks of round(m N / 5) * 5 patches in training ------------------------------------
def _masked_neighbours(mask: np.ndarray) -> float:
    """Mean number of masked 4-neighbours of a masked patch (about 1.6 for random masks of 20 of 49)."""
    padded = np.pad(mask.reshape(GRID, GRID), 1)
    counts = padded[:-2, 1:-1].astype(int) + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]
    return float(counts[mask.reshape(GRID, GRID)].mean())


def test_beit_pretraining_steps_mask_blocks_of_at_most_the_beit_count() -> None:
    """A real Fed-BEiT pre-training step: 0.4 of 49 patches -> at most 20 masked, in blocks (not scattered)."""
    site = _site("fed-beit", batch_size=48)
    masks: list[torch.Tensor] = []
    pretext = site.model.pretext_loss
    site.model.pretext_loss = lambda images, tokens, masked: masks.append(masked) or pretext(images, tokens, masked)
    global_params = _global("fed-beit")
    ctx = JOBS["fed-beit"][2]
    site.train({k: global_params[k] for k in site.spec.payload.shared_keys(list(global_params), "pretrain")}, ctx)
    counts = masks[0].sum(1).numpy()
    assert masks[0].shape == (48, 49) and counts.max() == 20 and counts.mean() >= 18
    assert np.mean([_masked_neighbours(m) for m in masks[0].numpy()]) > 2.5


# ----- 9. what travels in fine-tuning: the encoder and head, no pre-training module ---------------------------
@pytest.mark.parametrize(("method", "spec"), [("fed-mae", FED_MAE), ("fed-beit", FED_BEIT)])
def test_finetuning_sends_the_encoder_and_head_and_no_pretraining_module(method: str, spec: MethodSpec) -> None:
    keys = list(_global(method))
    sent = spec.payload.shared_keys(keys, "finetune")
    assert sorted(sent) == sorted(k for k in keys if k.startswith(("backbone.", "head.")))


# ----- 10. fine-tuning trains the whole network with layer-wise lr decay; pre-training without ----------------
def _lr_scales(site: SiteRuntime) -> dict[str, float]:
    scales = {id(p): g["lr_scale"] for g in site.trainer.optimizer.param_groups for p in g["params"]}
    return {name: scales[id(p)] for name, p in site.model.named_parameters() if id(p) in scales}


def test_finetuning_trains_every_layer_with_lr_decay_and_pretraining_without() -> None:
    """Fine-tuning: scale 0.65 ** (L + 1 - layer), patch embedding at layer 0, block i at i + 1, fc_norm and head
    at L + 1 = 7 (spec §4(a) stage 2); pre-training: every trained parameter at scale 1."""
    site = _site("fed-mae")
    global_params = _global("fed-mae")
    for ctx in (JOBS["fed-mae"][2], RoundContext(1, 2, "finetune", stage_round=0, stage_rounds=1)):
        site.train({k: global_params[k] for k in site.spec.payload.shared_keys(list(global_params), ctx.stage)}, ctx)
        if ctx.stage == "pretrain":
            assert set(_lr_scales(site).values()) == {1.0}
    scales = _lr_scales(site)
    expected = {"backbone.patch_embed.proj.weight": 0.65**7, "backbone.cls_token": 0.65**7, "head.weight": 1.0,
                "backbone.fc_norm.weight": 1.0, **{f"backbone.blocks.{i}.attn.qkv.weight": 0.65 ** (DEPTH - i)
                                                   for i in range(DEPTH)}}
    assert {k: scales.get(k) for k in expected} == pytest.approx(expected, rel=1e-9)
    assert set(scales) == {n for n in dict(site.model.named_parameters()) if n.startswith(("backbone.", "head."))}
