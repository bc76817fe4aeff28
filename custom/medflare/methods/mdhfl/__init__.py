"""MDH-FL: sites with their own architectures align their predictions on a shared public set (KL to a
confidence-weighted mix of the others') and train locally with symmetric cross-entropy against label noise. No
weight or architecture leaves a site and the server holds no model; the machinery also serves ``fedmd``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from medflare.data import DataConfig
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, TrainConfig, builtin_method
from medflare.methods.mdhfl.client import MdhflTrainer
from medflare.methods.mdhfl.paper import PAPER
from medflare.methods.mdhfl.protocol import PAYLOAD
from medflare.methods.mdhfl.server import MdhflRule

WEIGHTINGS = ("ccr", "mean")
LOCAL_LOSSES = ("sce", "ce")
KL_OPTIMIZERS = ("step", "persistent")
PROBS_DTYPES = ("float16", "float32")
# What the exchange tells the server (fedmd sends the same, without private_loss).
REVEALS = ("no weights and no architecture; the site model's softmax on each public chunk (a model-inversion or "
           "membership attack could use it), how fast its private loss falls (private_loss, for CCR), and the SHA-256 "
           "digest and size of its public-set copy")
# Why neither exchange method (mdhfl, fedmd) trains with DP-SGD
DP_BLOCKER = ("its distillation steps train the same model on public rows with a plain optimizer between its private "
              "steps, which Opacus's per-sample hooks and the accountant do not separate")
REFERENCE = ("Ahmad et al., Exploiting Model and Data Heterogeneity in FL (MDH-FL), 2023, with RHFL's "
             "client-confidence re-weighting (Fang and Ye, Robust Federated Learning with Noisy and Heterogeneous "
             "Clients, CVPR 2022)")


@dataclass
class MdhflConfig:
    """MDH-FL hyperparameters (spec §3(c); defaults follow the paper and the authors' code unless noted)."""

    distill: bool = True  # KL toward the others' predictions on public rows; false = the "w/o KL" ablation
    loss: str = "sce"  # local loss: sce (symmetric CE) | ce (the "w/o SCE" ablation)
    sce_alpha: float = 0.1  # weight of CE inside SCE (the paper's λ)
    sce_beta: float = 1.0  # weight of reverse CE inside SCE
    weighting: str = "ccr"  # ccr: RHFL's client-confidence re-weighting (in the code, not the paper) | mean
    ccr_beta: float = 0.5  # CCR strength β; 0 = uniform weights (the paper's Eq. 3 up to a constant factor)
    ccr_eps: float = 1e-6  # |Σ_j q_j| below this: uniform weights (the code divides unguarded)
    include_self: bool = False  # whether a site's own predictions are part of its target (FedMD: yes)
    chunks: int = 1  # M public chunks per round, one probability/target exchange each (1 = FedMD-like)
    public_per_round: int = 0  # public rows used per round; 0 = the whole set, else a window rotating by round
    local_epochs: int = 0  # E_l; 0 = train.local_epochs if set (not 1), else the code's max(N_public // N_private, 1)
    kl_optimizer: str = "step"  # step: a new Adam per KL step (the code; ≈ signSGD) | persistent: one for the job
    probs_dtype: str = "float16"  # how probabilities travel: float16 (half the bytes) | float32
    pretrain_epochs: int = 0  # RHFL's local warm-up before the first exchange (MDH-FL has none)

    def __post_init__(self) -> None:
        choices = (("weighting", WEIGHTINGS), ("loss", LOCAL_LOSSES), ("kl_optimizer", KL_OPTIMIZERS),
                   ("probs_dtype", PROBS_DTYPES))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ConfigError(f"method.{name} must be one of {', '.join(allowed)}, got '{getattr(self, name)}'")
        counts = (("chunks", self.chunks, 1), ("public_per_round", self.public_per_round, 0),
                  ("local_epochs", self.local_epochs, 0), ("pretrain_epochs", self.pretrain_epochs, 0))
        for name, value, low in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"method.{name} must be a whole number >= {low}, got {value!r}")
        if min(self.sce_alpha, self.sce_beta, self.ccr_beta) < 0 or self.ccr_eps <= 0:
            raise ConfigError("method.sce_alpha, sce_beta and ccr_beta must be >= 0 and ccr_eps > 0")
        # The server needs >= 2 rows per chunk; a set public_per_round caps the rows whatever the public set's size
        if self.distill and self.public_per_round and self.public_per_round < 2 * self.chunks:
            raise ConfigError(f"method.chunks={self.chunks} splits method.public_per_round={self.public_per_round} "
                              "public rows into chunks of fewer than 2 images; lower chunks or raise public_per_round")


def check_public_set(cfg: MdhflConfig, trains: Mapping[str, TrainConfig], data: DataConfig | None) -> list[str]:
    """MethodSpec.check_run: a simulation must hold out (or name) the public set every exchange starts from (a real
    site's ``medflare_site.json`` names it and the site checks it; ``distill=false`` exchanges nothing)."""
    if data is None or not cfg.distill or data.public_fraction or data.public_source:
        return []
    return ["its sites distil on an unlabelled public set and this simulation has none; set data.public_fraction "
            "(e.g. --set data.public_fraction=0.2, a held-out share of the training split) or data.public_source"]


# The local epochs' Adam is created once per round, its state kept across that round's epochs (spec §3(a) step 4);
# train.fresh_optimizer=never keeps it for the job instead.
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "batch_size": 16, "fresh_optimizer": "round"}

SMOKE = {"model": "cnn", "data": {"public_fraction": 0.2, "label_noise": 0.2, "noise_kind": "pairflip"},
         "train": {"max_steps": 2, "batch_size": 16}, "method_args": {"public_per_round": 32, "chunks": 2}}

SPEC = builtin_method(
    MethodSpec(
        name="mdhfl",
        dp_sgd_blocker=DP_BLOCKER,
        summary="MDH-FL: per-site architectures; KL to confidence-weighted public-set predictions + local SCE",
        config_cls=MdhflConfig,
        trainer_cls=MdhflTrainer,
        payload=PAYLOAD,
        server_rule_cls=MdhflRule,
        train_defaults=TRAIN_DEFAULTS,
        reference=REFERENCE,
        server_model=False,
        smoke=SMOKE,
        reveals=REVEALS,
        check_run=check_public_set,
        presets={"paper": PAPER},
    )
)
