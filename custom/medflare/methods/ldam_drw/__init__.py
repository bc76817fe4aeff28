"""LDAM-DRW-FL: FedAvg whose sites train a cosine classifier with the LDAM loss and deferred re-weighting."""

from dataclasses import dataclass

from medflare.methods.base import COUNTS_UNCOVERED, MethodSpec, builtin_method, require
from medflare.methods.ldam_drw.client import LdamDrwTrainer
from medflare.methods.ldam_drw.model import build_cosine_head_model

__all__ = ["LdamDrwConfig", "SPEC"]


@dataclass
class LdamDrwConfig:
    """LDAM-DRW options (defaults from Cao et al. and the Fed-MAS baselines, spec §1.10)."""

    max_margin: float = 0.5  # margin of the rarest local class; m_k ∝ n_k^(-1/4) is rescaled to this maximum
    scale: float = 30.0  # s: the loss (and evaluation) uses s · cosine logits
    drw_beta: float = 0.9999  # effective-number β of the class-balanced weights once DRW is on
    drw_start_fraction: float = 0.8  # re-weighting is on from round ⌈f · total_rounds⌉ (0-based); 1.0 = never

    def __post_init__(self) -> None:
        require(self.max_margin > 0, f"ldam-drw max_margin must be > 0, got {self.max_margin}")
        require(self.scale > 0, f"ldam-drw scale must be > 0, got {self.scale}")
        require(0.0 <= self.drw_beta < 1.0, f"ldam-drw drw_beta must be in [0, 1), got {self.drw_beta}")
        require(0.0 <= self.drw_start_fraction <= 1.0,
                f"ldam-drw drw_start_fraction must be in [0, 1], got {self.drw_start_fraction}")


SPEC = builtin_method(
    MethodSpec(
        name="ldam-drw",
        dp_sgd_uncovered=COUNTS_UNCOVERED,
        summary="LDAM-DRW-FL: local LDAM loss on a cosine head, class-balanced re-weighting from 80% of rounds",
        config_cls=LdamDrwConfig,
        trainer_cls=LdamDrwTrainer,
        build_model=build_cosine_head_model,
        reference="Cao et al., Learning Imbalanced Datasets with Label-Distribution-Aware Margin Loss, NeurIPS 2019 "
        "(as LDAM-FL in Elbatel et al., Fed-MAS, MICCAI 2023)",
    )
)
