"""BSM-FL: FedAvg whose sites train with the balanced softmax loss (long-tail baseline of Fed-MAS and FCA)."""

from dataclasses import dataclass

from medflare.methods.base import COUNTS_UNCOVERED, MethodSpec, builtin_method
from medflare.methods.bsm_fl.client import BalancedSoftmaxTrainer


@dataclass
class BsmFlConfig:
    """Balanced-softmax options."""

    eps: float = 1e-12  # prior floor: classes missing at a site get a log(eps) logit offset (spec §1.1)


SPEC = builtin_method(
    MethodSpec(
        name="bsm-fl",
        dp_sgd_uncovered=COUNTS_UNCOVERED,
        summary="BSM-FL: FedAvg with local balanced-softmax loss (label-prior-adjusted logits)",
        config_cls=BsmFlConfig,
        trainer_cls=BalancedSoftmaxTrainer,
        reference="Ren et al., Balanced Meta-Softmax for Long-Tailed Visual Recognition, NeurIPS 2020",
    )
)
