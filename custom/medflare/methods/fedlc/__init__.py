"""FedLC: FedAvg whose sites train with logit-calibrated cross-entropy (the "LCC" loss of the Fed-MAS repo)."""

from dataclasses import dataclass

from medflare.methods.base import COUNTS_UNCOVERED, MethodSpec, builtin_method, require
from medflare.methods.fedlc.client import FedLcTrainer

__all__ = ["FedLcConfig", "SPEC"]


@dataclass
class FedLcConfig:
    """FedLC options."""

    tau: float = 0.5  # calibration strength τ: the loss sees z_k − τ · n_k^(-1/4) (spec §1.10); 0 = plain CE

    def __post_init__(self) -> None:
        require(self.tau >= 0, f"fedlc tau must be >= 0, got {self.tau}")


SPEC = builtin_method(
    MethodSpec(
        name="fedlc",
        dp_sgd_uncovered=COUNTS_UNCOVERED,
        summary="FedLC: local CE on logits minus tau * n_k^(-1/4) (site counts), sample-count-weighted average",
        config_cls=FedLcConfig,
        trainer_cls=FedLcTrainer,
        reference="Zhang et al., Federated Learning with Label Distribution Skew via Logits Calibration, ICML 2022",
    )
)
