"""FedRS: restricted softmax, so a site does not push down the classifier rows of classes it never sees."""

from __future__ import annotations

from dataclasses import dataclass

from medflare.losses.restricted_softmax import RESTRICTION_MODES
from medflare.methods.base import COUNTS_UNCOVERED, MethodSpec, builtin_method, require
from medflare.methods.fedrs.client import FedRsTrainer
from medflare.methods.fedrs.server import FedRsRule

__all__ = ["FedRsConfig", "SPEC"]

LOSSES = ("bsm", "ce")


@dataclass
class FedRsConfig:
    """FedRS options."""

    alpha: float = 0.5  # restriction factor for classes the site lacks, in [0, 1]; 1 = no restriction (not tuned)
    # soft: the authors' code (alpha + (1 - alpha) * n_c / max n) | hard: the paper (alpha for missing classes only).
    # Soft by default: under loss=bsm the prior's log(eps) already silences missing classes, so hard trains as BSM-FL.
    restriction: str = "soft"
    loss: str = "bsm"  # bsm: balanced softmax on the restricted logits, as FCA's baselines | ce: FedRS as published
    eps: float = 1e-9  # bsm prior floor (FCA's value)

    def __post_init__(self) -> None:
        require(0.0 <= self.alpha <= 1.0, f"fedrs alpha must be in [0, 1], got {self.alpha}")
        require(self.restriction in RESTRICTION_MODES,
                f"fedrs restriction must be one of {RESTRICTION_MODES}, got '{self.restriction}'")
        require(self.loss in LOSSES, f"fedrs loss must be one of {LOSSES}, got '{self.loss}'")
        require(self.eps >= 0, f"fedrs eps must be >= 0, got {self.eps}")


SPEC = builtin_method(
    MethodSpec(
        name="fedrs",
        dp_sgd_uncovered=COUNTS_UNCOVERED,
        summary="FedRS: local (balanced) softmax with the logits of the site's missing classes scaled by alpha",
        config_cls=FedRsConfig,
        trainer_cls=FedRsTrainer,
        server_rule_cls=FedRsRule,
        reference="Li and Zhan, FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID "
        "Data, KDD 2021",
        smoke={"data": {"eval_split": "like_train"}},
    )
)
