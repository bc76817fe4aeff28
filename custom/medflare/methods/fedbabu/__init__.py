"""FedBABU: only the body learns federatedly under a frozen random head; the head is fine-tuned locally at the end."""

from __future__ import annotations

from dataclasses import dataclass

from medflare.contracts import Payload
from medflare.evaluation import FCA_PROTOCOL_DATA
from medflare.methods.base import MethodSpec, builtin_method, default_model_builder, require
from medflare.methods.fedbabu.client import FedBabuTrainer
from medflare.methods.fedbabu.server import FedBabuRule
from medflare.models import Classifier

__all__ = ["FedBabuConfig", "SPEC", "build_fedbabu_model"]


@dataclass
class FedBabuConfig:
    """FedBABU options."""

    finetune_epochs: int = 5  # epochs of local head fine-tuning before the specialization evaluation
    eps: float = 1e-9  # balanced-softmax prior floor (FCA's baselines use BSM with FCA's 1e-9)

    def __post_init__(self) -> None:
        require(self.finetune_epochs >= 0, f"fedbabu finetune_epochs must be >= 0, got {self.finetune_epochs}")
        require(self.eps >= 0, f"fedbabu eps must be >= 0, got {self.eps}")


def build_fedbabu_model(model: str, num_classes: int, in_channels: int, image_size: int, pretrained, cfg) -> Classifier:
    """The factory's classifier with its head frozen at the random initialisation the server broadcasts."""
    network = default_model_builder(model, num_classes, in_channels, image_size, pretrained)
    network.head.requires_grad_(False)
    return network


SPEC = builtin_method(
    MethodSpec(
        name="fedbabu",
        dp_sgd_uncovered=("eval_extra: its specialization score comes from a head fine-tuned without noise on the "
                          "site's training images; the class counts its loss reads"),
        summary="FedBABU: body trained and averaged under a frozen random head; head fine-tuned locally to evaluate",
        config_cls=FedBabuConfig,
        trainer_cls=FedBabuTrainer,
        server_rule_cls=FedBabuRule,
        payload=Payload(frozen_keys=r"^head\."),  # the random head travels but must come back unchanged
        build_model=build_fedbabu_model,
        reference="Oh, Kim and Yun, FedBABU: Towards Enhanced Representation for Federated Image Classification, "
        "ICLR 2022",
        data_defaults=FCA_PROTOCOL_DATA,  # FCA's protocol, under which FCA compares FedBABU (Tables 4-5)
    )
)
