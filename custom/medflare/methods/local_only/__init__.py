"""Local-only training: every site trains its own model on its own data; nothing but evaluation leaves it. The
reference of personalized and model-heterogeneous FL (FCA's specialization reference, MDH-FL's lower bound): no
weights travel, the server holds no model, and each site may run its own architecture."""

from __future__ import annotations

from dataclasses import dataclass

from medflare.contracts import Payload
from medflare.methods.base import MethodSpec, builtin_method, require
from medflare.methods.local_only.client import LOSSES, LocalOnlyReferenceTrainer
from medflare.methods.local_only.server import LocalOnlyRule


@dataclass
class LocalOnlyConfig:
    """Which local loss the site trains with (choose the one of the method you compare against)."""

    loss: str = "ce"  # ce | bsm (balanced softmax, as FCA's baselines) | sce (symmetric CE, as MDH-FL)
    eps: float = 1e-9  # bsm prior floor (FCA's value)
    sce_alpha: float = 0.1  # sce: weight of CE (RHFL / MDH-FL)
    sce_beta: float = 1.0  # sce: weight of reverse CE

    def __post_init__(self) -> None:
        require(self.loss in LOSSES, f"local-only loss must be one of {sorted(LOSSES)}, got '{self.loss}'")


SPEC = builtin_method(
    MethodSpec(
        name="local-only",
        summary="Local-only baseline: each site trains its own model (any architecture); no weights travel",
        config_cls=LocalOnlyConfig,
        trainer_cls=LocalOnlyReferenceTrainer,
        # Every key is private: nothing travels, and the whole model is kept in the site state across a restart.
        payload=Payload(sends_weights=False, private_keys=r".*"),
        server_rule_cls=LocalOnlyRule,
        server_model=False,
        reveals="nothing about the model: no weights and no architecture leave the site, only the common meta",
        reference="The no-collaboration reference of personalized FL (e.g. Wicaksana et al., FCA, 2023, Tables 2-3)",
    )
)
