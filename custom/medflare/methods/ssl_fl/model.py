"""SSL-FL networks: the ViT classifier of the fine-tuning stage plus the modules only pre-training uses. One network
holds everything a job's stages need, so the server keeps one global model and hands the encoder (``backbone.*``) from
stage to stage. Fed-MAE adds ``decoder.*`` (MAE's light decoder, mask token, the encoder's final norm); Fed-BEiT adds
``lm_head.*`` (mask token, norm, token classifier) and, with the federated tokenizer, ``tokenizer.*``."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from medflare.errors import ConfigError
from medflare.methods.ssl_fl.masking import random_mask
from medflare.methods.ssl_fl.tokenizer import DiscreteVae
from medflare.models.vit import VitClassifier

TOKENIZER, PRETRAIN, FINETUNE = "tokenizer", "pretrain", "finetune"
UNLABELLED_STAGES = (TOKENIZER, PRETRAIN)  # stages that learn from every image, labelled or not
HEAD_INIT_STD = 2e-5  # the classifier starts near zero (MAE: trunc-normal std 2e-5; BEiT: 0.02 x 0.001)
LN_EPS = 1e-6  # timm's ViT LayerNorm epsilon


def sincos_position_table(grid: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings ``[1, 1 + grid^2, dim]``, zeros for the class token (MAE)."""
    from timm.layers import build_sincos2d_pos_embed  # timm (with torchvision) is slow to import: only when used

    table = build_sincos2d_pos_embed([grid, grid], dim)
    return torch.cat([torch.zeros(1, dim), table], dim=0).unsqueeze(0)


def set_drop_path(vit: nn.Module, rate: float) -> None:
    """Stochastic depth ``rate * i / (depth - 1)`` in block ``i`` (timm's rule), changed in place between stages;
    ConfigError for a positive rate on a ViT built without stochastic depth (no DropPath modules to set)."""
    from timm.layers import DropPath

    blocks = list(vit.blocks)
    paths = [(i, m) for i, block in enumerate(blocks) for m in (block.drop_path1, block.drop_path2)]
    settable = [(i, m) for i, m in paths if isinstance(m, DropPath)]
    if rate > 0 and len(blocks) > 1 and not settable:
        raise ConfigError("stochastic depth was asked for in a stage, but the ViT was built without it")
    for i, module in settable:
        module.drop_prob = rate * i / max(len(blocks) - 1, 1)


class MaskedImageNet(VitClassifier):
    """A ViT classifier (``backbone``, ``head``) with pre-training modules; subclasses add them."""

    NOT_SENT: dict[str, str] = {}  # stage -> regex of state-dict keys that do not travel in it (builds the Payload)
    TRAINED: dict[str, str] = {FINETUNE: r"^(backbone|head)\."}  # stage -> regex of the parameters it trains

    def __init__(self, classifier: VitClassifier) -> None:
        from timm.layers import trunc_normal_

        super().__init__(classifier.backbone, classifier.head)
        trunc_normal_(self.head.weight, std=HEAD_INIT_STD)
        nn.init.zeros_(self.head.bias)

    @property
    def grid(self) -> int:
        """Patches per side."""
        return int(self.backbone.patch_embed.grid_size[0])

    @property
    def patch(self) -> int:
        """Patch side in pixels."""
        return int(self.backbone.patch_embed.patch_size[0])

    def train_only(self, stage: str) -> None:
        """Let exactly the parameters ``stage`` trains require gradients."""
        if stage not in self.TRAINED:
            raise ConfigError(f"{type(self).__name__} has no stage '{stage}'; its stages: {sorted(self.TRAINED)}")
        pattern = re.compile(self.TRAINED[stage])
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(pattern.search(name) is not None)

    def encoder_norm(self) -> nn.LayerNorm:
        """The encoder's final norm as pre-training trained it (MAE: ``decoder.encoder_norm``, BEiT:
        ``lm_head.norm``); the export pools the encoder's tokens through it."""
        raise NotImplementedError

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Transformer blocks over ``[class token, tokens]``; ``tokens`` already carry their position embedding."""
        vit = self.backbone
        cls = (vit.cls_token + vit.pos_embed[:, :1]).expand(len(tokens), -1, -1)
        return vit.blocks(vit.norm_pre(vit.pos_drop(torch.cat([cls, tokens], dim=1))))


class MaeDecoder(nn.Module):
    """MAE's decoder: the encoder's final norm, a projection, mask tokens at the hidden positions, fixed sine-cosine
    positions, a few transformer blocks and a linear map to the ``patch_pixels`` values (patch^2 x channels) of each
    patch. ``dim``, ``depth``, ``heads``: decoder width, blocks and attention heads (ViT-B MAE: 512, 8, 16)."""

    def __init__(self, width: int, grid: int, patch_pixels: int, dim: int, depth: int, heads: int) -> None:
        from timm.layers import trunc_normal_
        from timm.models.vision_transformer import Block

        super().__init__()
        self.encoder_norm = nn.LayerNorm(width, eps=LN_EPS)
        self.embed = nn.Linear(width, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        trunc_normal_(self.mask_token, std=0.02)
        self.register_buffer("pos_embed", sincos_position_table(grid, dim), persistent=False)  # fixed: never sent
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=LN_EPS)
        self.pred = nn.Linear(dim, patch_pixels)

    def forward(self, latent: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
        """Predicted pixels ``[B, N, patch_pixels]`` from the encoded ``[class, visible...]`` tokens."""
        x = self.embed(self.encoder_norm(latent))
        batch, patches = restore.shape
        visible = x[:, 1:]
        tokens = torch.cat([visible, self.mask_token.expand(batch, patches - visible.shape[1], -1)], dim=1)
        tokens = torch.gather(tokens, 1, restore.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = torch.cat([x[:, :1], tokens], dim=1) + self.pos_embed
        return self.pred(self.norm(self.blocks(x)))[:, 1:]


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, N, patch * patch * C]``, patches row by row (the patch-token order)."""
    b, c, h, w = images.shape
    grid_h, grid_w = h // patch, w // patch
    x = images.reshape(b, c, grid_h, patch, grid_w, patch).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, grid_h * grid_w, patch * patch * c)


def masked_patch_loss(pred: torch.Tensor, target: torch.Tensor, masked: torch.Tensor, norm_pix: bool) -> torch.Tensor:
    """MAE's loss on ``[B, N, P]`` patch pixels: per-patch MSE averaged over pixels, then over the ``masked``
    (``[B, N]``, 1 = hidden from the encoder) patches only; ``norm_pix`` first standardises each target patch by its
    own mean and (unbiased) variance + 1e-6."""
    if norm_pix:
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    per_patch = ((pred - target) ** 2).mean(dim=-1)
    return (per_patch * masked).sum() / masked.sum()


class FedMaeNet(MaskedImageNet):
    """ViT classifier + MAE decoder. The encoder's ``pos_embed`` is overwritten with fixed sine-cosine positions, frozen
    in pre-training and trainable in fine-tuning (MAE's fine-tuning model loads them into a learnable embedding).
    ``mask_ratio``: share of patches hidden per image; ``norm_pix``: MAE's ``norm_pix_loss``."""

    NOT_SENT = {PRETRAIN: r"^(head|backbone\.fc_norm)\.", FINETUNE: r"^decoder\."}
    TRAINED = {PRETRAIN: r"^(backbone\.(?!fc_norm\.|pos_embed$)|decoder\.)", **MaskedImageNet.TRAINED}

    def __init__(self, classifier: VitClassifier, decoder_dim: int, decoder_depth: int, decoder_heads: int,
                 mask_ratio: float, norm_pix: bool) -> None:
        super().__init__(classifier)
        vit = self.backbone
        with torch.no_grad():
            vit.pos_embed.copy_(sincos_position_table(self.grid, vit.embed_dim))
        channels = vit.patch_embed.proj.in_channels
        self.decoder = MaeDecoder(vit.embed_dim, self.grid, self.patch**2 * channels, decoder_dim, decoder_depth,
                                  decoder_heads)
        self.mask_ratio, self.norm_pix = mask_ratio, norm_pix

    def encoder_norm(self) -> nn.LayerNorm:
        return self.decoder.encoder_norm

    def pretext_loss(self, images: torch.Tensor) -> torch.Tensor:
        """Reconstruction loss on the masked patches of a freshly masked batch."""
        vit = self.backbone
        tokens = vit.patch_embed(images) + vit.pos_embed[:, 1:]
        mask = random_mask(len(images), tokens.shape[1], self.mask_ratio, images.device)
        visible = torch.gather(tokens, 1, mask.keep.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        pred = self.decoder(self.encode(visible), mask.restore)
        return masked_patch_loss(pred, patchify(images, self.patch), mask.masked, self.norm_pix)


class BeitLmHead(nn.Module):
    """BEiT's pre-training head: the mask token fed in place of hidden patches, the encoder's final norm and the
    linear classifier over visual tokens (``lm_head``)."""

    def __init__(self, width: int, vocab: int) -> None:
        from timm.layers import trunc_normal_

        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        trunc_normal_(self.mask_token, std=0.02)
        self.norm = nn.LayerNorm(width, eps=LN_EPS)
        self.proj = nn.Linear(width, vocab)
        trunc_normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)


class FedBeitNet(MaskedImageNet):
    """ViT classifier (built with layer scale, as BEiT) + BEiT head over ``vocab`` visual tokens (8192 with DALL-E),
    with the federated dVAE ``tokenizer`` (``tokenizer.*``), or None when every site reads a DALL-E encoder."""

    NOT_SENT = {
        TOKENIZER: r"^(?!tokenizer\.)",
        PRETRAIN: r"^(head\.|backbone\.fc_norm\.|tokenizer\.(?!encoder\.))",
        FINETUNE: r"^(lm_head|tokenizer)\.",
    }
    TRAINED = {TOKENIZER: r"^tokenizer\.", PRETRAIN: r"^(backbone\.(?!fc_norm\.)|lm_head\.)", **MaskedImageNet.TRAINED}

    def __init__(self, classifier: VitClassifier, vocab: int, tokenizer: DiscreteVae | None) -> None:
        super().__init__(classifier)
        self.lm_head = BeitLmHead(self.backbone.embed_dim, vocab)
        self.tokenizer = tokenizer

    def encoder_norm(self) -> nn.LayerNorm:
        return self.lm_head.norm

    def pretext_loss(self, images: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the visual tokens (int64 ``[B, N]``, of the whole images) of the ``masked`` (bool
        ``[B, N]``) patches, which the encoder sees as mask tokens."""
        vit, head = self.backbone, self.lm_head
        patches = vit.patch_embed(images)
        weight = masked.unsqueeze(-1).to(patches.dtype)
        patches = patches * (1 - weight) + head.mask_token * weight
        encoded = self.encode(patches + vit.pos_embed[:, 1:])[:, 1:]
        logits = head.proj(head.norm(encoded[masked]))
        return F.cross_entropy(logits, tokens[masked])
