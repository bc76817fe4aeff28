"""SCAFFOLD: non-IID sites: control variates c_i (kept at the site) and c (sent by the server) correct each local SGD step for client drift

Written by `medflare new-method scaffold`: it starts as FedAvg (cross-entropy locally, sample-count-weighted average).
"""

from dataclasses import dataclass

from medflare.contracts import Payload
from medflare.methods.base import MethodSpec, builtin_method
from medflare.methods.scaffold.client import ScaffoldTrainer
from medflare.methods.scaffold.server import ScaffoldRule


@dataclass
class ScaffoldConfig:
    """scaffold's options (``--set method.<option>=...``); check each in ``__post_init__`` with ``base.require``."""


SPEC = builtin_method(
    MethodSpec(
        name="scaffold",
        summary="SCAFFOLD: non-IID sites: control variates c_i (kept at the site) and c (sent by the server) correct each local SGD step for client drift",
        config_cls=ScaffoldConfig,
        trainer_cls=ScaffoldTrainer,
        server_rule_cls=ScaffoldRule,
        # What travels: every weight and the common meta. Keys that never leave a site: private_keys=r"^head\.";
        # extra meta or arrays: meta={...}, arrays={...} (docs/architecture.md, "What leaves a site")
        payload=Payload(),
        reference="Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020",
    )
)
