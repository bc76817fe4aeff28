"""SSL-FL trainer wiring (methods/ssl_fl/ledger.toml): which tensors each pretext loss receives from the trainer,
which layers it reaches, the state a site keeps or resets from round to round, and the defaults against the
paper's Table I and the scripts (spec §4(a), (c)). Fast: ``vit_micro`` at 28 px, one step per round, no simulator."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import medflare.methods.ssl_fl.model as ssl_model
from medflare.methods.base import RoundContext
from medflare.methods.ssl_fl import FED_BEIT, FED_MAE, FedBeitConfig, FedMaeConfig
from medflare.methods.ssl_fl.masking import beit_mask_count
from medflare.methods.ssl_fl.model import FINETUNE, PRETRAIN, TOKENIZER
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec, resolve_train_config
from medflare.site_runtime import SiteRuntime

MODEL = "vit_micro"  # 7 x 7 patches of 4 px at 28 px
GRID, PATCH = 7, 4
TASK = TaskSpec(num_classes=3, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=120,classes=3", "num_sites": 2, "partition": "iid"}
BATCH = 8
SPECS = {"fed-mae": FED_MAE, "fed-beit": FED_BEIT}
# no stochastic depth in pre-training, so a hand-written forward pass reproduces the trainer's
BEIT_ARGS = {"tokenizer_rounds": 1, "pretrain_rounds": 2, "pretrain_drop_path": 0.0, "min_code_perplexity": 0.0}
MAE_ARGS = {"pretrain_rounds": 2}


def _site(method: str, method_args: dict, **train: object) -> SiteRuntime:
    settings = SiteSettings(
        spec=get_method(method), task=TASK, data=DATA, model=MODEL, method_args=method_args,
        train={"max_steps": 1, "batch_size": BATCH, "eval_batch_size": 64, **train}, evaluation="off",
    )
    return SiteRuntime(settings, "site-1", 0, log=lambda message: None)


def _ctx(round_: int, total: int, stage: str, stage_round: int, stage_rounds: int) -> RoundContext:
    return RoundContext(round_, total, stage, stage_round=stage_round, stage_rounds=stage_rounds,
                        scored=stage == FINETUNE)


def _train(site: SiteRuntime, ctx: RoundContext) -> dict[str, Any]:
    """One round on ``site``, receiving its own current weights of the stage (nothing else changes them)."""
    spec = SPECS[site.settings.method]
    own = {k: v.detach().cpu().numpy() for k, v in site.model.state_dict().items()}
    _, meta = site.train({k: own[k] for k in spec.payload.shared_keys(list(own), ctx.stage)}, ctx)
    return meta


def _pixels_by_patch(images: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, N, p * p * C]``: patch j is the j-th patch row by row, its pixels (row, column,
    channel); written with ``F.unfold`` (channel-major) and reordered, independently of ``patchify``."""
    batch, channels = images.shape[:2]
    columns = F.unfold(images, PATCH, stride=PATCH)  # [B, C * p * p, N]
    return columns.view(batch, channels, PATCH * PATCH, -1).permute(0, 3, 2, 1).reshape(batch, GRID * GRID, -1)


def _record_batches(site: SiteRuntime, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The images of every batch the trainer hands its loss."""
    batches: list[torch.Tensor] = []
    compute_loss = site.trainer.compute_loss

    def recording(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batches.append(images.detach().clone())
        return compute_loss(images, labels)

    monkeypatch.setattr(site.trainer, "compute_loss", recording)
    return batches


def _mae_prediction_by_hand(net: Any, images: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """MAE's forward pass written out (paper §III-B, spec §4(a)): the encoder sees the class token and the visible
    patches with their positions; the decoder puts each visible token back at its patch position, a mask token at
    every other, adds its own positions and predicts every patch's pixels."""
    vit, decoder = net.backbone, net.decoder
    batch, rows = len(images), torch.arange(len(images))[:, None]
    tokens = vit.patch_embed(images) + vit.pos_embed[:, 1:]
    cls = (vit.cls_token + vit.pos_embed[:, :1]).expand(batch, -1, -1)
    latent = vit.blocks(vit.norm_pre(torch.cat([cls, tokens[rows, keep]], dim=1)))
    x = decoder.embed(decoder.encoder_norm(latent))
    placed = decoder.mask_token.expand(batch, GRID * GRID, -1).clone()
    placed[rows, keep] = x[:, 1:]
    x = torch.cat([x[:, :1], placed], dim=1) + decoder.pos_embed
    return decoder.pred(decoder.norm(decoder.blocks(x)))[:, 1:]


# ----- (a) which tensors each pretext loss receives from the trainer -------------------------------------------
@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_the_mae_loss_gets_the_decoders_predictions_the_batchs_pixels_and_the_masked_patches(
    norm_pix_loss: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the trainer: the reconstruction loss receives MAE's predictions of every patch (by hand), the
    batch's own pixels patch by patch as targets, the mask the encoder was given, and the job's norm_pix_loss."""
    site = _site("fed-mae", {**MAE_ARGS, "norm_pix_loss": norm_pix_loss})
    batches = _record_batches(site, monkeypatch)
    masks, calls = [], []
    random_mask, masked_patch_loss = ssl_model.random_mask, ssl_model.masked_patch_loss

    def recording_mask(*args: Any, **kwargs: Any) -> Any:
        masks.append(random_mask(*args, **kwargs))
        return masks[-1]

    def recording_loss(pred: torch.Tensor, target: torch.Tensor, masked: torch.Tensor, norm_pix: bool) -> torch.Tensor:
        with torch.no_grad():
            expected = _mae_prediction_by_hand(site.model, batches[-1], masks[-1].keep)
        calls.append((pred.detach().clone(), expected, target.detach().clone(), masked.clone(), norm_pix))
        return masked_patch_loss(pred, target, masked, norm_pix)

    monkeypatch.setattr(ssl_model, "random_mask", recording_mask)
    monkeypatch.setattr(ssl_model, "masked_patch_loss", recording_loss)
    _train(site, _ctx(0, 3, PRETRAIN, 0, 2))
    [(pred, expected, target, masked, norm_pix)], [images], [mask] = calls, batches, masks
    assert pred.shape == target.shape == (BATCH, GRID * GRID, PATCH * PATCH * 3)
    torch.testing.assert_close(pred, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(target, _pixels_by_patch(images))  # raw pixels: norm_pix is applied inside the loss
    assert torch.equal(masked, mask.masked) and masked.sum(dim=1).eq(GRID * GRID - mask.keep.shape[1]).all()
    assert norm_pix is norm_pix_loss is site.model.norm_pix


def _beit_logits_by_hand(net: Any, images: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """BEiT's forward pass written out (paper §III-B, spec §4(a)): the mask token in place of every masked patch,
    positions added, the class token in front; the lm_head's logits of the encoder's outputs at the masked patches,
    row by row."""
    vit, head = net.backbone, net.lm_head
    patches = torch.where(masked[..., None], head.mask_token, vit.patch_embed(images)) + vit.pos_embed[:, 1:]
    cls = (vit.cls_token + vit.pos_embed[:, :1]).expand(len(images), -1, -1)
    encoded = vit.blocks(vit.norm_pre(torch.cat([cls, patches], dim=1)))[:, 1:]
    return head.proj(head.norm(encoded[masked]))


def test_the_beit_loss_gets_the_tokenizers_codes_of_the_masked_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the trainer: the masked-token cross-entropy receives, row by row over the masked patches, the
    lm_head's logits of the encoder's outputs there (the encoder saw the mask token in their place; by hand) and
    the frozen tokenizer's codes of the same batch at the same positions; the mask has BEiT's count."""
    site = _site("fed-beit", BEIT_ARGS)
    net = site.model
    _train(site, _ctx(0, 4, TOKENIZER, 0, 1))
    batches = _record_batches(site, monkeypatch)
    inputs, calls = [], []
    pretext_loss = net.pretext_loss

    def recording_pretext(images: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        inputs.append((tokens.clone(), masked.clone()))
        return pretext_loss(images, tokens, masked)

    class RecordingFunctional:  # model.py's ``F``, its cross_entropy recorded with the logits expected by hand
        def __getattr__(self, name: str) -> Any:
            return getattr(F, name)

        @staticmethod
        def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            with torch.no_grad():
                expected = _beit_logits_by_hand(net, batches[-1], inputs[-1][1])
            calls.append((logits.detach().clone(), expected, targets.clone(), kwargs))
            return F.cross_entropy(logits, targets, **kwargs)

    monkeypatch.setattr(net, "pretext_loss", recording_pretext)
    monkeypatch.setattr(ssl_model, "F", RecordingFunctional())
    _train(site, _ctx(1, 4, PRETRAIN, 0, 2))
    [images], [(tokens, masked)], [(logits, expected, targets, kwargs)] = batches, inputs, calls
    count = beit_mask_count(GRID * GRID, FedBeitConfig().mask_ratio)
    assert masked.dtype == torch.bool and masked.shape == (BATCH, GRID * GRID)
    assert 0 < int(masked.sum(dim=1).min()) and int(masked.sum(dim=1).max()) <= count
    assert torch.equal(tokens, net.tokenizer.tokens(images))  # the frozen tokenizer's codes of this very batch
    assert torch.equal(targets, tokens[masked]) and kwargs == {}  # masked positions only, in patch order
    assert logits.shape == (int(masked.sum()), FedBeitConfig().vocab_size)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


# ----- (c) every layer on the pretext path learns ---------------------------------------------------------------
def _gradients_after_one_step(site: SiteRuntime, ctx: RoundContext) -> dict[str, torch.Tensor | None]:
    _train(site, ctx)
    return {name: p.grad for name, p in site.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method, args, ctx, named", [
    ("fed-mae", MAE_ARGS, _ctx(0, 3, PRETRAIN, 0, 2),
     ["backbone.patch_embed.proj.weight", "backbone.cls_token", "backbone.blocks.0.attn.qkv.weight",
      "decoder.encoder_norm.weight", "decoder.embed.weight", "decoder.mask_token", "decoder.blocks.0.mlp.fc1.weight",
      "decoder.norm.weight", "decoder.pred.weight"]),
    ("fed-beit", BEIT_ARGS, _ctx(1, 4, PRETRAIN, 0, 2),
     ["backbone.patch_embed.proj.weight", "backbone.cls_token", "backbone.blocks.0.attn.qkv.weight",
      "backbone.blocks.5.ls2.gamma", "lm_head.mask_token", "lm_head.norm.weight", "lm_head.proj.weight"]),
    ("fed-beit", BEIT_ARGS, _ctx(0, 4, TOKENIZER, 0, 1),
     ["tokenizer.encoder.0.weight", "tokenizer.encoder.6.weight", "tokenizer.encoder.7.weight", "tokenizer.codebook.weight",
      "tokenizer.decoder.0.weight", "tokenizer.decoder.8.weight"]),
])
def test_every_layer_a_pretext_stage_trains_gets_a_gradient(method: str, args: dict, ctx: RoundContext,
                                                             named: list[str]) -> None:
    """One step through the trainer: every parameter the stage trains has a nonzero gradient (the patch embedding,
    the class token, every block, the mask token, the decoder or lm_head, the dVAE's every layer), none is merely
    attached."""
    site = _site(method, args)
    if ctx.stage == PRETRAIN and method == "fed-beit":
        _train(site, _ctx(0, 4, TOKENIZER, 0, 1))
    grads = _gradients_after_one_step(site, ctx)
    assert set(named) <= set(grads)
    silent = [name for name, grad in grads.items() if grad is None or not bool(grad.abs().sum() > 0)]
    assert silent == []


# ----- (b) state over rounds on one site ------------------------------------------------------------------------
def _adam_steps(site: SiteRuntime) -> set[int]:
    return {int(state["step"]) for state in site.trainer.optimizer.state.values()}


@pytest.mark.parametrize("method, args, stages", [
    ("fed-mae", MAE_ARGS, [(PRETRAIN, 2), (FINETUNE, 2)]),
    ("fed-beit", BEIT_ARGS, [(TOKENIZER, 1), (PRETRAIN, 2), (FINETUNE, 1)]),
])
def test_the_optimizer_state_persists_over_a_stages_rounds_and_restarts_at_the_next_stage(
    method: str, args: dict, stages: list[tuple[str, int]]
) -> None:
    """Spec §4(a): per-client optimizer state persists across rounds; each stage trains other modules with its own
    settings, so it starts a new optimizer (``fresh_optimizer: stage``)."""
    site = _site(method, args)
    total, round_ = sum(rounds for _, rounds in stages), 0
    for stage, rounds in stages:
        first = None
        for stage_round in range(rounds):
            _train(site, _ctx(round_, total, stage, stage_round, rounds))
            round_ += 1
            first = first or site.trainer.optimizer
            assert site.trainer.optimizer is first and _adam_steps(site) == {stage_round + 1}, (stage, stage_round)


def test_beit_code_statistics_are_the_rounds_own_and_the_temperature_follows_the_round() -> None:
    """Two tokenizer rounds and two pre-training rounds on one site: each round reports the codes of its own
    batch only (never the previous round's too), and each tokenizer round trains at its own Gumbel temperature."""
    args = {**BEIT_ARGS, "tokenizer_rounds": 2, "tau_start": 1.0, "tau_end": 0.25}
    site = _site("fed-beit", args)
    cfg = site.trainer.cfg
    rounds = [_ctx(0, 5, TOKENIZER, 0, 2), _ctx(1, 5, TOKENIZER, 1, 2), _ctx(2, 5, PRETRAIN, 0, 2),
              _ctx(3, 5, PRETRAIN, 1, 2)]
    for ctx in rounds:
        meta = _train(site, ctx)
        assert int(site.trainer.code_counts.sum()) == BATCH * GRID * GRID, ctx  # this round's batch only
        assert 1 <= meta["codes_used"] <= cfg.vocab_size
        if ctx.stage == TOKENIZER:
            assert site.model.tokenizer.temperature == pytest.approx(cfg.temperature(ctx.stage_round, 2))
    assert site.model.tokenizer.temperature == pytest.approx(0.25)


# ----- defaults: the paper's Table I and the scripts -------------------------------------------------------------
def test_fed_mae_defaults_follow_the_paper_and_scripts() -> None:
    """Spec §4(a), (c): mask ratio 0.6; pre-training AdamW betas (0.9, 0.95), wd 0.05, blr 2e-3 x batch / 256
    (Retina: 1e-3 at batch 128), cosine to 0; fine-tuning blr 3e-3 x batch / 256, layer decay 0.65, cosine to 1e-6,
    drop path 0.1, label smoothing 0.1, Mixup 0.8 / CutMix 1.0 switching with prob 0.5; no stochastic depth in
    pre-training."""
    cfg = FedMaeConfig()
    assert (cfg.mask_ratio, cfg.pretrain_drop_path, cfg.drop_path, cfg.label_smoothing) == (0.6, 0.0, 0.1, 0.1)
    assert (cfg.mixup, cfg.cutmix, cfg.mixup_switch_prob) == (0.8, 1.0, 0.5)
    finetune = resolve_train_config(FED_MAE, {"batch_size": 128})
    pretrain = finetune.for_stage(PRETRAIN)
    assert pretrain.optimizer == "adamw" and tuple(pretrain.betas) == (0.9, 0.95) and pretrain.weight_decay == 0.05
    assert pretrain.lr * pretrain.batch_size / pretrain.base_batch == pytest.approx(1e-3)  # Table I, Retina
    assert (pretrain.layer_decay, pretrain.min_lr, pretrain.lr_schedule) == (1.0, 0.0, "warmup_cosine")
    assert (finetune.lr, finetune.base_batch, finetune.weight_decay, finetune.layer_decay) == (3e-3, 256, 0.05, 0.65)
    assert (finetune.min_lr, finetune.lr_schedule, finetune.fresh_optimizer) == (1e-6, "warmup_cosine", "stage")
    assert tuple(finetune.betas) == (0.9, 0.999)
    preset = FED_MAE.presets["paper"].overrides
    assert (preset["rounds"], preset["method_args"]["pretrain_rounds"], preset["method_args"]["finetune_rounds"]) == (
        1700, 1600, 100)
    assert preset["train"]["stages"][PRETRAIN]["batch_size"] == 128 and preset["train"]["batch_size"] == 256
    assert preset["train"]["stages"][PRETRAIN]["warmup_rounds"] == 5.0  # the paper's (the scripts: 40)
    method_args = preset["method_args"]
    assert (method_args["decoder_dim"], method_args["decoder_depth"], method_args["decoder_heads"]) == (512, 8, 16)
    assert method_args["mask_ratio"] == 0.6 and method_args["norm_pix_loss"] is True


def test_fed_beit_defaults_follow_the_paper_and_scripts() -> None:
    """Spec §4(a), (c): mask ratio 0.4 (paper), pre-training drop path 0.1, layer scale 0.1, absolute lr 1.5e-3
    (Table I, Retina) with AdamW's default betas, wd 0.05, min lr 1e-5, clip 3.0; fine-tuning lr 3e-3 (absolute),
    drop path 0.2, layer decay 0.65, label smoothing 0.1 and no Mixup/CutMix."""
    cfg = FedBeitConfig()
    assert (cfg.mask_ratio, cfg.pretrain_drop_path, cfg.drop_path, cfg.layer_scale) == (0.4, 0.1, 0.2, 0.1)
    assert (cfg.label_smoothing, cfg.mixup, cfg.cutmix) == (0.1, 0.0, 0.0)
    finetune = resolve_train_config(FED_BEIT, {"batch_size": 64})
    pretrain = finetune.for_stage(PRETRAIN)
    assert (pretrain.lr, pretrain.base_batch, pretrain.min_lr, pretrain.layer_decay) == (1.5e-3, 0, 1e-5, 1.0)
    assert tuple(pretrain.betas) == (0.9, 0.999) and pretrain.weight_decay == 0.05 and pretrain.grad_clip == 3.0
    assert (finetune.lr, finetune.base_batch, finetune.layer_decay, finetune.grad_clip) == (3e-3, 0, 0.65, 3.0)
    assert (finetune.min_lr, finetune.weight_decay, finetune.fresh_optimizer) == (1e-6, 0.05, "stage")
    preset = FED_BEIT.presets["paper"].overrides
    method_args = preset["method_args"]
    assert (method_args["pretrain_rounds"], method_args["finetune_rounds"], method_args["vocab_size"]) == (1000, 100, 8192)
    assert method_args["mask_ratio"] == 0.4 and preset["train"]["stages"][PRETRAIN]["warmup_rounds"] == 10.0
    assert preset["train"]["stages"][PRETRAIN]["lr"] == 1.5e-3 and preset["train"]["lr"] == 3e-3

