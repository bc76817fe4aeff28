"""FedRep: a shared body learnt federatedly, a personal head per site that never leaves it."""

from __future__ import annotations

from dataclasses import dataclass

from medflare.contracts import Payload
from medflare.evaluation import FCA_PROTOCOL_DATA
from medflare.methods.base import MethodSpec, builtin_method, require
from medflare.methods.fedrep.client import FedRepTrainer
from medflare.methods.fedrep.server import FedRepRule

__all__ = ["FedRepConfig", "SPEC"]


@dataclass
class FedRepConfig:
    """FedRep options."""

    head_epochs: int = 10  # epochs of personal-head training per round before the body trains (paper: 10)
    eps: float = 1e-9  # balanced-softmax prior floor (FCA's baselines use BSM with FCA's 1e-9)

    def __post_init__(self) -> None:
        require(self.head_epochs >= 0, f"fedrep head_epochs must be >= 0, got {self.head_epochs}")
        require(self.eps >= 0, f"fedrep eps must be >= 0, got {self.eps}")


SPEC = builtin_method(
    MethodSpec(
        name="fedrep",
        dp_sgd_blocker=("its personal head trains on the site's features with a plain optimizer each round, and the "
                        "shared body's steps then depend on that head"),
        summary="FedRep: shared body averaged; each site's head (BSM) trained first each round and never sent",
        config_cls=FedRepConfig,
        trainer_cls=FedRepTrainer,
        payload=Payload(private_keys=r"^head\."),
        server_rule_cls=FedRepRule,
        reference="Collins et al., Exploiting Shared Representations for Personalized Federated Learning, ICML 2021",
        data_defaults=FCA_PROTOCOL_DATA,  # FCA's protocol, under which FCA compares FedRep (Tables 4-5)
        global_classifier=False,  # every head is private: the saved global model is a body without a head
    )
)
