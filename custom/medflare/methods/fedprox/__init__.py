"""FedProx: FedAvg plus a proximal term that keeps local weights near the received global model."""

from dataclasses import dataclass

from medflare.methods.base import MethodSpec, builtin_method, require
from medflare.methods.fedprox.client import FedProxTrainer


@dataclass
class FedProxConfig:
    """FedProx options."""

    mu: float = 0.01  # proximal weight; the Fed-MAS appendix sweeps {0.1, 0.01, 0.001}

    def __post_init__(self) -> None:
        require(self.mu >= 0, f"fedprox mu must be >= 0, got {self.mu}")


SPEC = builtin_method(
    MethodSpec(
        name="fedprox",
        dp_sgd_blocker=("its proximal term mu/2·||w - w_global||² has no per-sample gradient, and DP-SGD replaces "
                        "the batch gradient with the noised sum of per-sample ones, so the term would vanish"),
        summary="FedProx: cross-entropy + (mu/2)||w - w_global||^2, sample-count-weighted average",
        config_cls=FedProxConfig,
        trainer_cls=FedProxTrainer,
        reference="Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020",
        multi_label=True,  # BCE over known entries instead of CE on multi-label tasks
    )
)
