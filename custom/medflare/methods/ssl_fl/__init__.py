"""SSL-FL: federated masked-image pre-training (Fed-MAE, Fed-BEiT), then federated fine-tuning, in one job.
Registers ``fed-mae`` and ``fed-beit``; the scratch baseline is ``fed-mae`` with ``pretrain_rounds=0`` (same
network, initialisation and fine-tuning recipe, without pre-training)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from medflare.contracts import MAX_SAMPLES, Payload, non_negative_number
from medflare.data.transforms import AUGMENTATIONS
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, Stage, builtin_method
from medflare.methods.ssl_fl.client import CODE_PERPLEXITY, CODES_USED, N_IMAGES, FedBeitTrainer, FedMaeTrainer
from medflare.methods.ssl_fl.model import FINETUNE, PRETRAIN, TOKENIZER, FedBeitNet, FedMaeNet
from medflare.methods.ssl_fl.paper import PRESETS as PAPER_PRESETS
from medflare.methods.ssl_fl.server import SslFlRule
from medflare.methods.ssl_fl.tokenizer import DiscreteVae

REFERENCE = ("Yan, Qu, Wei, Huang, Shen, Rubin, Xing and Zhou, Label-Efficient Self-Supervised Federated Learning for "
             "Tackling Data Heterogeneity in Medical Imaging, IEEE TMI 2023 (code: rui-yan/SSL-FL)")
DVAE = "dvae"
AUTO = "auto"
NORM_PIX_MIN_PATCH = 16  # MAE's patch size, where norm_pix_loss was validated
DALLE_PREFIX = "dall-e:"


@dataclass
class SslFlConfig:
    """Stage budgets and fine-tuning recipe shared by Fed-MAE and Fed-BEiT (spec §4(a), (c))."""

    pretrain_rounds: int = 1  # rounds of masked-image pre-training (paper: 1600 MAE, 1000 BEiT); 0 = from scratch
    finetune_rounds: int = -1  # rounds of supervised fine-tuning (paper: 100); -1 = the job's remaining rounds
    mask_ratio: float = 0.6  # share of patches masked per image (paper: MAE 0.6, BEiT 0.4)
    pretrain_drop_path: float = 0.0  # stochastic depth in pre-training (MAE none, BEiT 0.1)
    drop_path: float = 0.1  # stochastic depth in fine-tuning (MAE 0.1, BEiT 0.2)
    label_smoothing: float = 0.1  # fine-tuning (both)
    mixup: float = 0.8  # fine-tuning Mixup alpha (MAE 0.8, BEiT off); 0 = off
    cutmix: float = 1.0  # fine-tuning CutMix alpha (MAE 1.0, BEiT off); 0 = off
    mixup_switch_prob: float = 0.5  # chance a mixed batch uses CutMix instead of Mixup (MAE 0.5)
    # Training views per stage (data/transforms.py; data.augment is not used): the scripts' Retina recipes, §4(c)
    pretrain_augment: str = "mae_pretrain"  # pre-training (and BEiT's tokenizer): crop 0.2-1, grey, jitter 0.4, flip
    finetune_augment: str = "ssl_finetune"  # fine-tuning: random resized crop 0.6-1, rotation 10°, flip

    def __post_init__(self) -> None:
        checks = [
            (self.pretrain_rounds >= 0, "pretrain_rounds must be >= 0"),
            (self.finetune_rounds >= -1, "finetune_rounds must be >= 0, or -1 for the job's remaining rounds"),
            (0.0 < self.mask_ratio < 1.0, "mask_ratio must be in (0, 1)"),
            (0.0 <= self.pretrain_drop_path < 1.0 and 0.0 <= self.drop_path < 1.0, "drop_path rates must be in [0, 1)"),
            (0.0 <= self.label_smoothing < 1.0, "label_smoothing must be in [0, 1)"),
            (self.mixup >= 0 and self.cutmix >= 0, "mixup and cutmix alphas must be >= 0"),
            (0.0 <= self.mixup_switch_prob <= 1.0, "mixup_switch_prob must be in [0, 1]"),
            (self.pretrain_augment in AUGMENTATIONS and self.finetune_augment in AUGMENTATIONS,
             f"pretrain_augment and finetune_augment must be one of {AUGMENTATIONS}"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ConfigError(f"{type(self).__name__}: " + "; ".join(problems))

    def pre_stages(self) -> list[tuple[str, int]]:
        """The unlabelled stages before fine-tuning and their budgets."""
        return [(PRETRAIN, self.pretrain_rounds)]

    def stage_plan(self, total_rounds: int) -> list[Stage]:
        """The job's stages in order: unscored pre-training stages, then the scored fine-tuning stage (ConfigError
        for ``finetune_rounds=-1`` with no round left for it)."""
        before = [(name, rounds) for name, rounds in self.pre_stages() if rounds > 0]
        finetune = self.finetune_rounds
        if finetune < 0:
            finetune = total_rounds - sum(rounds for _, rounds in before)
            if finetune < 1:
                plan = ", ".join(f"{name}_rounds={rounds}" for name, rounds in self.pre_stages())
                raise ConfigError(f"the job has rounds={total_rounds} but {plan} leave none for fine-tuning; raise "
                                  "rounds, or set method.finetune_rounds=0 for a pre-training-only job")
        stages = [Stage(name, rounds, scored=False) for name, rounds in before]
        return stages + ([Stage(FINETUNE, finetune)] if finetune > 0 else [])


@dataclass
class FedMaeConfig(SslFlConfig):
    """Fed-MAE: random masking, a light decoder, pixel regression on the masked patches."""

    # standardise each target patch (every SSL-FL script, at 16-px patches); auto = on for patches of >= 16 px,
    # off below: at 4-px patches (16 values per channel) it collapsed the features (README, Deviations)
    norm_pix_loss: bool | str = AUTO
    decoder_dim: int = 128  # decoder width (ViT-B MAE: 512; this default is CPU-sized)
    decoder_depth: int = 2  # decoder blocks (ViT-B MAE: 8)
    decoder_heads: int = 4  # decoder attention heads (ViT-B MAE: 16)

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.decoder_dim, self.decoder_depth, self.decoder_heads) < 1 or self.decoder_dim % self.decoder_heads:
            raise ConfigError("fed-mae decoder_dim, decoder_depth, decoder_heads must be >= 1, dim divisible by heads")
        if isinstance(self.norm_pix_loss, str) and self.norm_pix_loss != AUTO:
            raise ConfigError(f"fed-mae norm_pix_loss must be true, false or '{AUTO}', got '{self.norm_pix_loss}'")

    def norm_pix(self, patch: int) -> bool:
        """Whether targets are standardised per patch at ``patch`` px: ``norm_pix_loss``, or with ``auto`` on from
        MAE's 16-px patches up (256 values per channel) and off for smaller patches, whose few pixels give a
        noisy per-patch mean and variance."""
        if self.norm_pix_loss == AUTO:
            return patch >= NORM_PIX_MIN_PATCH
        return bool(self.norm_pix_loss)


@dataclass
class FedBeitConfig(SslFlConfig):
    """Fed-BEiT: block-wise masking, cross-entropy on visual tokens from a dVAE tokenizer."""

    mask_ratio: float = 0.4
    pretrain_drop_path: float = 0.1
    drop_path: float = 0.2
    mixup: float = 0.0
    cutmix: float = 0.0
    pretrain_augment: str = "beit_pretrain"  # BEiT's order: grey, jitter, flip, then the crop
    tokenizer: str = DVAE  # dvae (trained federatedly in its own stage) | dall-e:PATH (a local DALL-E encoder file)
    tokenizer_rounds: int = 1  # rounds of the federated dVAE stage; 0 with dall-e:PATH
    vocab_size: int = 512  # visual tokens (BEiT/DALL-E: 8192; this default is CPU-sized); set 8192 with DALL-E
    dvae_hidden: int = 64  # dVAE convolution width
    dvae_code_dim: int = 64  # dVAE codebook vector width
    dvae_kl_weight: float = 0.0  # weight of KL(q || uniform) in the dVAE loss (DALL-E's customized dVAE: 0)
    dvae_usage_weight: float = 1.0  # weight of KL(batch-averaged q || uniform): keeps the codebook in use
    # the stage fails when the visual tokens of the pre-training images have a lower perplexity (exp of the
    # entropy of their code histogram, image-weighted mean over sites); 0 = no floor
    min_code_perplexity: float = 16.0
    tau_start: float = 1.0  # Gumbel-softmax temperature at the start of the tokenizer stage (DALL-E: 1)
    tau_end: float = 1.0 / 16  # ... at its last round (DALL-E anneals to 1/16)
    block_min_patches: int = 0  # smallest masking block; 0 = BEiT's 16 per 196 patches, scaled to the grid
    layer_scale: float = 0.1  # initial layer-scale value of every block (BEiT: 0.1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer != DVAE and not self.tokenizer.startswith(DALLE_PREFIX):
            raise ConfigError(f"fed-beit tokenizer must be '{DVAE}' or '{DALLE_PREFIX}PATH', got '{self.tokenizer}'")
        if self.tokenizer_rounds < 0 or (self.tokenizer_rounds > 0 and (self.dalle_path or not self.pretrain_rounds)):
            raise ConfigError("fed-beit tokenizer_rounds must be 0 with a DALL-E tokenizer or without pre-training "
                              f"(set method.tokenizer_rounds=0), and >= 0; got {self.tokenizer_rounds}")
        if self.tokenizer == DVAE and self.pretrain_rounds and not self.tokenizer_rounds:
            raise ConfigError("fed-beit with the federated dVAE needs tokenizer_rounds >= 1 before pre-training")
        if self.vocab_size < 2 or min(self.dvae_hidden, self.dvae_code_dim) < 1 or min(
                self.dvae_kl_weight, self.dvae_usage_weight, self.min_code_perplexity) < 0:
            raise ConfigError("fed-beit vocab_size must be >= 2, dvae sizes >= 1, dvae_kl_weight, dvae_usage_weight "
                              "and min_code_perplexity >= 0")
        if not 0 < self.tau_end <= self.tau_start or self.layer_scale <= 0:
            raise ConfigError("fed-beit needs 0 < tau_end <= tau_start and layer_scale > 0")

    @property
    def dalle_path(self) -> str:
        """The DALL-E encoder file, or "" for the federated dVAE."""
        return self.tokenizer.removeprefix(DALLE_PREFIX) if self.tokenizer.startswith(DALLE_PREFIX) else ""

    def pre_stages(self) -> list[tuple[str, int]]:
        return [(TOKENIZER, self.tokenizer_rounds), (PRETRAIN, self.pretrain_rounds)]

    def temperature(self, stage_round: int, stage_rounds: int) -> float:
        """Gumbel-softmax temperature of a tokenizer-stage round: log-linear from tau_start to tau_end."""
        progress = stage_round / max(stage_rounds - 1, 1)
        return self.tau_start * math.exp(progress * math.log(self.tau_end / self.tau_start))


def _vit(model: str, num_classes: int, in_channels: int, image_size: int, cfg: SslFlConfig, layer_scale: float | None):
    from medflare.models.vit import build_vit, vit_size

    return build_vit(vit_size(model), num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                     drop_path_rate=max(cfg.drop_path, cfg.pretrain_drop_path), layer_scale=layer_scale)


def _load_pretrained(network: Any, pretrained: str | None) -> Any:
    """``--pretrained FILE``: an encoder file or a previous run's FL_global_model.pt (chained jobs)."""
    if pretrained:
        from medflare.models import load_weights

        load_weights(network, pretrained)
    return network


def build_fed_mae(model: str, num_classes: int, in_channels: int, image_size: int, pretrained, cfg: FedMaeConfig) -> FedMaeNet:
    """The ViT classifier with MAE's decoder (``model`` must be a ``vit_*`` name)."""
    classifier = _vit(model, num_classes, in_channels, image_size, cfg, layer_scale=None)
    patch = int(classifier.backbone.patch_embed.patch_size[0])
    network = FedMaeNet(
        classifier, cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads, cfg.mask_ratio, cfg.norm_pix(patch),
    )
    return _load_pretrained(network, pretrained)


def build_fed_beit(model: str, num_classes: int, in_channels: int, image_size: int, pretrained, cfg: FedBeitConfig) -> FedBeitNet:
    """The layer-scaled ViT classifier with BEiT's head, plus the federated dVAE unless DALL-E is used."""
    classifier = _vit(model, num_classes, in_channels, image_size, cfg, layer_scale=cfg.layer_scale)
    patch = int(classifier.backbone.patch_embed.patch_size[0])
    tokenizer = None if cfg.dalle_path else DiscreteVae(in_channels, patch, cfg.vocab_size, cfg.dvae_hidden, cfg.dvae_code_dim)
    return _load_pretrained(FedBeitNet(classifier, cfg.vocab_size, tokenizer), pretrained)


#: The CPU-sized default recipe: the flat options are the fine-tuning stage's, train.stages the others.
_FINETUNE = {"optimizer": "adamw", "weight_decay": 0.05, "no_decay_norm_bias": True, "layer_decay": 0.65,
             "lr_schedule": "warmup_cosine", "warmup_rounds": 1.0, "min_lr": 1e-6, "fresh_optimizer": "stage"}
MAE_TRAIN_DEFAULTS = {
    **_FINETUNE, "lr": 3e-3, "base_batch": 256,  # MAE fine-tuning: blr 3e-3 x batch / 256
    "stages": {PRETRAIN: {"lr": 2e-3, "betas": [0.9, 0.95], "layer_decay": 1.0, "min_lr": 0.0}},  # blr (Retina)
}
BEIT_TRAIN_DEFAULTS = {**_FINETUNE, "lr": 3e-3, "grad_clip": 3.0,  # BEiT: absolute lr, clip 3.0
                       "stages": {PRETRAIN: {"lr": 1.5e-3, "layer_decay": 1.0, "min_lr": 1e-5},
                                  TOKENIZER: {"lr": 1e-3, "weight_decay": 0.0, "layer_decay": 1.0, "warmup_rounds": 0.0,
                                              "min_lr": 1e-5, "grad_clip": 0.0}}}
PAYLOAD_META = {N_IMAGES: non_negative_number(N_IMAGES, upper=MAX_SAMPLES)}
# the visual tokens' code statistics on the round's images (tokenizer and pre-training)
BEIT_PAYLOAD_META = {**PAYLOAD_META, CODES_USED: non_negative_number(CODES_USED, upper=MAX_SAMPLES),
                     CODE_PERPLEXITY: non_negative_number(CODE_PERPLEXITY, upper=MAX_SAMPLES)}
SMOKE_DATA = {"source": "synthetic:n=160,n_val=40,n_test=40,imbalance=2", "partition": "iid"}


# Why neither SSL-FL method trains with DP-SGD (MethodSpec.dp_sgd_blocker)
SSL_DP_BLOCKER = ("its fine-tuning mixes pairs of images (MixUp/CutMix) into one training row, so no gradient belongs "
                  "to one sample")


def _register(name: str, summary: str, config_cls: type, trainer_cls: type, network_cls: type, build_model: Any,
              train_defaults: dict, smoke: dict, meta: dict = PAYLOAD_META, reveals: str = "") -> MethodSpec:
    """One SSL-FL method: its stages' wire declaration comes from the network's ``NOT_SENT`` table."""
    return builtin_method(MethodSpec(
        name=name, summary=summary, config_cls=config_cls, trainer_cls=trainer_cls,
        payload=Payload(stage_excluded_keys=network_cls.NOT_SENT, meta=meta), server_rule_cls=SslFlRule,
        build_model=build_model, train_defaults=train_defaults, reference=REFERENCE,
        smoke={"model": "vit_micro", "data": SMOKE_DATA, **smoke}, default_model="vit_tiny",
        presets=PAPER_PRESETS.get(name, {}), **({"reveals": reveals} if reveals else {}), dp_sgd_blocker=SSL_DP_BLOCKER,
    ))


FED_MAE = _register(
    "fed-mae", "Fed-MAE: federated masked-autoencoder pre-training of a ViT, then federated fine-tuning (one job)",
    FedMaeConfig, FedMaeTrainer, FedMaeNet, build_fed_mae, MAE_TRAIN_DEFAULTS,
    {"rounds": 2, "method_args": {"pretrain_rounds": 1}},
)
FED_BEIT = _register(
    "fed-beit", "Fed-BEiT: federated dVAE tokenizer, BEiT pre-training of a ViT, then federated fine-tuning (one job)",
    FedBeitConfig, FedBeitTrainer, FedBeitNet, build_fed_beit, BEIT_TRAIN_DEFAULTS,
    # the smoke job's one-step tokenizer cannot reach the codebook floor: it checks the wiring, not the tokens
    {"rounds": 3, "method_args": {"tokenizer_rounds": 1, "pretrain_rounds": 1, "min_code_perplexity": 0.0}},
    meta=BEIT_PAYLOAD_META,
    reveals=("in the tokenizer and pre-training stages, how many of the visual-token codes occur in the site's "
             "round and the perplexity of their histogram (two numbers: how varied its images look to the tokenizer)"),
)
