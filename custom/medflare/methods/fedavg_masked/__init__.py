"""FedAvg* ("task-dependent" aggregation, FPSL): FedAvg whose classifier rows are averaged only over the sites
that annotate each class. The masked-aggregation baseline of FedLSM's paper (Tables 1-2, marked *)."""

from __future__ import annotations

from dataclasses import dataclass

from medflare.contracts import Payload, class_mask
from medflare.methods.base import MethodSpec, builtin_method
from medflare.methods.fedavg_masked.client import FedAvgMaskedTrainer
from medflare.methods.fedavg_masked.server import MaskedClassifierRule
from medflare.methods.fedlsm.server import IDENTIFIED_KEY


@dataclass
class FedAvgMaskedConfig:
    """FedAvg* has no hyperparameters: the classifier is the model's ``head.*`` (every registered network's)."""


SPEC = builtin_method(
    MethodSpec(
        name="fedavg-masked",
        dp_sgd_uncovered="identified: which classes the site annotates",
        summary="FedAvg* (FPSL's task-dependent aggregation): classifier row c averaged over the sites labelling c",
        config_cls=FedAvgMaskedConfig,
        trainer_cls=FedAvgMaskedTrainer,
        payload=Payload(meta={IDENTIFIED_KEY: class_mask(IDENTIFIED_KEY)}),
        server_rule_cls=MaskedClassifierRule,
        reference=("Dong, Kampffmeyer, Voiculescu and Xing, Federated Partially Supervised Learning with Limited "
                   "Decentralized Medical Images, IEEE TMI 2022 (as inferred in spec §5(e)8; used by FedLSM's "
                   "baselines)"),
        multi_label=True,
        smoke={"data": {"partition": "labelset:3"}},
        reveals="which classes the site annotates (one 0/1 per class)",
    )
)
