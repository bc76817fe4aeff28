"""FedMD baseline: every site distils toward the consensus (mean) of all sites' predictions on public rows, then
revisits its private data with cross-entropy (no client-confidence weights, no label-noise-robust loss). It runs
the MDH-FL exchange with FedMD's choices: only probabilities and scalars leave a site; the server holds no model."""

from __future__ import annotations

from dataclasses import dataclass

from medflare.methods.base import MethodSpec, builtin_method
from medflare.methods.mdhfl import DP_BLOCKER, REVEALS, SMOKE, MdhflConfig, check_public_set
from medflare.methods.mdhfl.client import MdhflTrainer
from medflare.methods.mdhfl.protocol import PAYLOAD
from medflare.methods.mdhfl.server import MdhflRule


@dataclass
class FedMdConfig(MdhflConfig):
    """MDH-FL's options with FedMD's defaults (Li and Wang 2019): consensus over all sites, CE, plain Adam."""

    loss: str = "ce"  # FedMD revisits private data with plain cross-entropy
    weighting: str = "mean"  # the consensus is an unweighted mean (no CCR)
    include_self: bool = True  # ... over every site, the site's own predictions included
    kl_optimizer: str = "persistent"  # an ordinary Adam kept across steps (FedMD compiles its models once)


SPEC = builtin_method(
    MethodSpec(
        name="fedmd",
        dp_sgd_blocker=DP_BLOCKER,
        summary="FedMD: per-site architectures; KL to the mean of all sites' public-set predictions + local CE",
        config_cls=FedMdConfig,
        trainer_cls=MdhflTrainer,
        payload=PAYLOAD,
        server_rule_cls=MdhflRule,
        train_defaults={"optimizer": "adam", "lr": 1e-3, "batch_size": 16, "fresh_optimizer": "never"},
        reference="Li and Wang, FedMD: Heterogenous Federated Learning via Model Distillation, NeurIPS 2019 workshop",
        server_model=False,
        smoke=SMOKE,
        reveals=REVEALS,
        check_run=check_public_set,
    )
)
