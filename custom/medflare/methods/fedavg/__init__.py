"""FedAvg with cross-entropy: the baseline every paper compares against."""

from dataclasses import dataclass

from medflare.methods.base import MethodSpec, builtin_method
from medflare.methods.fedavg.client import FedAvgTrainer


@dataclass
class FedAvgConfig:
    """FedAvg has no hyperparameters beyond the shared TrainConfig."""


SPEC = builtin_method(
    MethodSpec(
        name="fedavg",
        summary="FedAvg: cross-entropy locally, sample-count-weighted average of all weights",
        config_cls=FedAvgConfig,
        trainer_cls=FedAvgTrainer,
        reference="McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, 2017",
        multi_label=True,  # BCE over known entries instead of CE on multi-label tasks
    )
)
