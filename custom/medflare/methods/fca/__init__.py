"""FCA: federated classifier anchoring. A personal head at each site anchors the federated head through a
consistency loss; the personal head never leaves its site."""

from __future__ import annotations

from dataclasses import dataclass

from medflare.contracts import Payload
from medflare.evaluation import FCA_PROTOCOL_DATA
from medflare.methods.base import COUNTS_UNCOVERED, MethodSpec, builtin_method, default_model_builder, require
from medflare.methods.fca.client import FcaTrainer
from medflare.methods.fca.loss import CONSISTENCY_MODES
from medflare.methods.fca.model import PERSONAL_HEAD_KEYS, FcaNet
from medflare.methods.fca.paper import PAPER
from medflare.methods.fca.server import FcaRule

__all__ = ["FcaConfig", "SPEC", "build_fca_model"]

REFERENCE = ("Wicaksana, Yan and Cheng, FCA: Taming Long-tailed Federated Medical Image Classification by Classifier "
             "Anchoring, 2023")


@dataclass
class FcaConfig:
    """FCA hyperparameters (spec §6(c); defaults follow the paper and the authors' notebook)."""

    lambda_fed: float = 1.0  # λ₁: weight of BSM on the federated head (paper Table 7: λ₁ = 1, λ₂ = 3 best)
    lambda_personal: float = 3.0  # λ₂: weight of BSM on the personal head
    consistency_weight: float = 1.0  # weight of L_con (1 in the paper; 0 = the "no CR" ablation of Table 7)
    consistency: str = "kl"  # kl: KL(p_personal ‖ p_federated) as the paper states | repo: the notebook's variant
    temperature: float = 1.0  # T of the consistency term
    eps: float = 1e-9  # BSM prior floor (FCA's value, spec §1.1)

    def __post_init__(self) -> None:
        require(self.consistency in CONSISTENCY_MODES,
                f"fca consistency must be one of {CONSISTENCY_MODES}, got '{self.consistency}'")
        weights = {"lambda_fed": self.lambda_fed, "lambda_personal": self.lambda_personal,
                   "consistency_weight": self.consistency_weight, "eps": self.eps}
        negative = [f"{name}={value}" for name, value in weights.items() if not value >= 0]
        require(not negative, f"fca {', '.join(negative)}: these weights must be >= 0")
        require(self.temperature > 0, f"fca temperature must be > 0, got {self.temperature}")


def build_fca_model(model: str, num_classes: int, in_channels: int, image_size: int, pretrained, cfg) -> FcaNet:
    """Any classifier from the factory with a parallel personal head on its pooled features."""
    return FcaNet(default_model_builder(model, num_classes, in_channels, image_size, pretrained))


# Paper and notebook: Adam lr 1e-3, weight decay 5e-4 (L2), batch 64, one local epoch, 80 rounds with lr × 0.1
# at rounds 60 and 70 (0-based stage rounds here, so from the 61st and 71st round; spec §6(a) "Schedule").
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "weight_decay": 5e-4, "batch_size": 64, "local_epochs": 1,
                  "lr_schedule": "multistep", "milestones": (60, 70), "gamma": 0.1}

SPEC = builtin_method(
    MethodSpec(
        name="fca",
        dp_sgd_uncovered=COUNTS_UNCOVERED,
        summary="FCA: personal head per site (never sent) anchors the federated head via KL; BSM on both heads",
        config_cls=FcaConfig,
        trainer_cls=FcaTrainer,
        payload=Payload(private_keys=PERSONAL_HEAD_KEYS),
        server_rule_cls=FcaRule,
        build_model=build_fca_model,
        train_defaults=TRAIN_DEFAULTS,
        reference=REFERENCE,
        presets={"paper": PAPER},
        smoke={"model": "cnn"},
        # the offline stand-in for the paper's ImageNet B0 (no B0 weights offline; README, Deviations):
        # --pretrained imagenet loads Lite0's offline ImageNet weights; --model efficientnet_b0 is B0 from scratch
        default_model="efficientnet_lite0",
        data_defaults=FCA_PROTOCOL_DATA,  # each site's test split follows its training class mix (§4.2)
    )
)
