"""Fed-MAS: aggregation weighted by a per-site rescue factor from a frozen self-supervised prior. Also registers
``bsm-kd``, the paper's ablation (BSM + KD to the prior, sample-count aggregation, no RF)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from medflare.contracts import ContractContext, MetaValidator, Payload, positive_number
from medflare.data import DataConfig
from medflare.errors import ConfigError
from medflare.methods.base import COUNTS_UNCOVERED, MethodSpec, TrainConfig, builtin_method, default_model_builder
from medflare.methods.fed_mas.client import RF_KEY, FedMasTrainer
from medflare.methods.fed_mas.model import FedMasNet
from medflare.methods.fed_mas.paper import PAPER
from medflare.methods.fed_mas.plots import plot_divergence
from medflare.methods.fed_mas.prior import IMAGENET_LITE0, prior_feature_dim
from medflare.methods.fed_mas.rescue import eq3_bound
from medflare.methods.fed_mas.server import FedMasRule

AGGREGATIONS = ("mas", "mas_inv", "mas_drw", "samples")
PRIOR_PRECISIONS = ("fp32", "reduced")
# Training augmentations with at most two views of an image (none; weak = a flip), the only ones the prior cache fits
FIXED_VIEW_AUGMENTATIONS = ("none", "weak")
REFERENCE = ("Elbatel, Wang, Martí, Fu and Li, Federated Model Aggregation via Self-Supervised Priors for Highly "
             "Imbalanced Medical Image Classification, MICCAI 2023 workshops")


@dataclass
class FedMasConfig:
    """Fed-MAS hyperparameters (spec §2(c); defaults follow the paper unless noted)."""

    lambda_f: float = 3.0  # weight of the distillation distance L_f (paper ablation: 0, 1, 3; 7 hurts)
    aux_head_weight: float = 1.0  # BSM on the projector's auxiliary head (code, not paper; spec §2(e)1)
    aggregation: str = "mas"  # mas | mas_inv | mas_drw | samples (samples = the BSM-FL w/ KD ablation)
    # RF over w, ŵ normalised to sum 1 (the authors' code, whose numbers the paper reports); false = Eq. 3 as printed,
    # RF = Σ_k w_k ŵ_k, which a shift raising every class's divergence alike does raise (README, "Deviations")
    rf_normalise: bool = True
    max_share: float = 0.0  # cap on any one site's share of the aggregate; 0 = off (the paper's rule)
    prior: str = IMAGENET_LITE0  # imagenet-lite0 | moco:PATH | torchscript:PATH | state_dict:PATH
    prior_dim: int = 0  # feature dimension of a torchscript/state_dict prior (others are known)
    prior_model: str = "resnet50"  # medflare model name of a state_dict prior
    prior_input_size: int = 64  # images are resized to this for the prior (paper: 224; 64 keeps CPU runs cheap)
    projector_hidden: int = 0  # projector hidden width; 0 = the backbone's feature width (as the code)
    drw_start: float = 0.8  # mas_drw: re-weighting by 1/RF from round ⌊drw_start · R⌋ (0-based) on
    drw_beta: float = 0.9999  # mas_drw: effective-number β
    eps: float = 1e-12  # BSM prior floor (spec §1.1)
    repo_compat_teacher_bn: bool = False  # reproduce the authors' teacher-BN bug in round 0 (spec §2(e)5)
    # Cost shortcuts (issue 15), each off by default (the paper's behaviour) and a documented deviation:
    cache_prior_features: bool = False  # reuse the prior's feature of an identical input (augment none/weak only)
    prior_precision: str = "fp32"  # fp32 | reduced: the prior under autocast, bf16 on CPU, fp16 on CUDA
    w_pass_per_class: int = 0  # 0 = w over every training image; N = over a stratified draw of <= N per class

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"fedmas aggregation must be one of {AGGREGATIONS}, got '{self.aggregation}'")
        if self.lambda_f < 0 or self.aux_head_weight < 0:
            raise ConfigError("fedmas lambda_f and aux_head_weight must be >= 0")
        if not 0 <= self.drw_start <= 1 or not 0 <= self.drw_beta < 1:
            raise ConfigError(f"fedmas drw_start must be in [0, 1] and drw_beta in [0, 1), got {self.drw_start}, "
                              f"{self.drw_beta}")
        if self.prior_precision not in PRIOR_PRECISIONS or self.w_pass_per_class < 0:
            raise ConfigError(f"fedmas prior_precision must be one of {PRIOR_PRECISIONS} and w_pass_per_class >= 0 "
                              f"(0 = every image), got '{self.prior_precision}', {self.w_pass_per_class}")
        if not self.rf_normalise and self.aggregation == "mas_inv":
            raise ConfigError("fedmas rf_normalise=false (Eq. 3) has no inverse form: 1/ŵ_k of a barely drifting "
                              "class has no bound; use aggregation=mas or mas_drw, or keep rf_normalise=true")
        if not 0 <= self.max_share <= 1:
            raise ConfigError(f"fedmas max_share must be in [0, 1], got {self.max_share}")
        prior_feature_dim(self.prior, self.prior_dim)  # fails early on an unknown prior


@dataclass
class BsmKdConfig(FedMasConfig):
    """The ablation: everything of Fed-MAS except RF; sites are weighted by sample count."""

    aggregation: str = "samples"


def build_fedmas_model(model: str, num_classes: int, in_channels: int, image_size: int, pretrained, cfg) -> FedMasNet:
    """Classifier from the factory plus projector and auxiliary head sized for the prior."""
    classifier = default_model_builder(model, num_classes, in_channels, image_size, pretrained)
    return FedMasNet(classifier, prior_feature_dim(cfg.prior, cfg.prior_dim), cfg.projector_hidden)


def check_prior_cache(cfg: FedMasConfig, trains: Mapping[str, TrainConfig], data: DataConfig | None) -> list[str]:
    """MethodSpec.check_run: a simulation's augmentation must suit the prior cache (each site would refuse it at
    its first task, after ``check_finite_views`` drew the views); a real site's own data is checked there."""
    if data is None or not cfg.cache_prior_features or data.augment in FIXED_VIEW_AUGMENTATIONS:
        return []
    return [f"method.cache_prior_features=true needs training images with a fixed set of views, but "
            f"data.augment={data.augment} draws new ones; set data.augment to one of "
            f"{', '.join(FIXED_VIEW_AUGMENTATIONS)}, or turn the cache off"]


def rf_validator(cfg: FedMasConfig) -> MetaValidator:
    """RF's check at both ends: > 0 and <= 1 normalised; > 0 and <= :func:`eq3_bound` of the task's K and the job's
    most local epochs as Eq. 3 prints it (what the job's own sites can reach; the job's share cap still holds)."""
    normalised = positive_number(RF_KEY, upper=1.0 + 1e-9)

    def check(value: Any, ctx: ContractContext) -> float:
        if cfg.rf_normalise:
            return normalised(value, ctx)
        return positive_number(RF_KEY, upper=eq3_bound(ctx.num_classes, ctx.local_epochs))(value, ctx)

    return check


def fedmas_payload(cfg: FedMasConfig) -> Payload:
    """What a Fed-MAS site sends besides its weights: RF, bounded as the job's RF form can reach."""
    return Payload(meta={RF_KEY: rf_validator(cfg)})


TRAIN_DEFAULTS = {"grad_clip": 5.0}  # clipping at 5.0 is in the code, not the paper (spec §2(e)6)

SPEC = builtin_method(
    MethodSpec(
        name="fedmas",
        dp_sgd_uncovered="RF, computed from the site's private images outside the noised steps; the site's class "
                         "counts its loss reads",
        summary="Fed-MAS: BSM + distillation to a frozen prior; sites weighted by rescue factor RF",
        config_cls=FedMasConfig,
        trainer_cls=FedMasTrainer,
        payload=fedmas_payload(FedMasConfig()),
        payload_for=fedmas_payload,
        server_rule_cls=FedMasRule,
        build_model=build_fedmas_model,
        train_defaults=TRAIN_DEFAULTS,
        reference=REFERENCE,
        site_log_plot=plot_divergence,
        check_run=check_prior_cache,
        presets={"paper": PAPER},
        reveals=("RF, one number in (0, 1] (up to K·16·E with rf_normalise=false): how much the site's class-wise "
                 "distances to the prior changed during local training; not the per-class distances w and ŵ, which "
                 "stay in the site's own log"),
    )
)

BSM_KD_SPEC = builtin_method(
    MethodSpec(
        name="bsm-kd",
        dp_sgd_uncovered=COUNTS_UNCOVERED,
        summary="BSM-FL w/ KD (Fed-MAS ablation): BSM + distillation to the prior, sample-count aggregation",
        config_cls=BsmKdConfig,
        trainer_cls=FedMasTrainer,
        server_rule_cls=FedMasRule,
        build_model=build_fedmas_model,
        train_defaults=TRAIN_DEFAULTS,
        reference=REFERENCE + " (Table 2 ablation)",
        check_run=check_prior_cache,
    )
)
