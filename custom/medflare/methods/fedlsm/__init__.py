"""FedLSM: federated learning when each site labels only some classes (label-set mismatch), single- or multi-label.
The data decides which: class-id labels train with softmax and one-hot pseudo-labels, multi-hot labels with
sigmoid, τ_p/τ_n pseudo-labels and a per-element weighted BCE using the server's global pos_weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from medflare.data.transforms import AUGMENTATIONS
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, TrainConfig, builtin_method
from medflare.methods.fedlsm.client import FedLsmTrainer
from medflare.methods.fedlsm.paper import PAPER
from medflare.methods.fedlsm.server import CLASSIFIER_KEYS, PAYLOAD, FedLsmRule

AGGREGATIONS = ("awpa", "masked", "samples")
POS_WEIGHT_MODES = ("element", "positive")
REFERENCE = ("Deng, Luo and Chen, Scale Federated Learning for Label Set Mismatch in Medical Image Classification, "
             "MICCAI 2023")


@dataclass
class FedLsmConfig:
    """FedLSM hyperparameters (spec §5(c); paper Table 4 where paper and code differ, spec §5(e)3-4)."""

    tau: float = 0.95  # single-label pseudo-label threshold (pseudo pool and D^l partners)
    tau_uncertain: float = 0.85  # single-label τ_l for D^h MixUp partners (paper; the code's config: 0.7)
    tau_pos: float = 0.85  # multi-label τ_p: an unknown entry at or above it becomes 1
    tau_neg: float = 5e-3  # multi-label τ_n: at or below it becomes 0 (paper; the code's config: 0.01)
    tau_uncertain_pos: float = 0.7  # multi-label τ_lp for D^h partners
    tau_uncertain_neg: float = 1e-2  # multi-label τ_ln for D^h partners (paper; the code's config: 0.005)
    uncertain_pool: float = 0.05  # n^h: a count (>= 1) or a fraction of the site's training set (< 1)
    confident_pool: float = 0.2  # n^l, the same way (ISIC: 50 / 200 of ~1400 per site)
    mix_batch: int = 4  # UDE rows per batch, taken out of train.batch_size (64 = 60 pseudo-pool + 4 mixed)
    lambda_ude: float = 0.1  # weight of the UDE loss
    mixup_alpha: float = 0.2  # λ ~ Beta(α, α), one λ per batch
    ema_decay: float = 0.999  # EMA teacher decay
    local_iterations: int = 30  # T batches per round (ISIC 30; CXR config 10, paper 200); 0 = one pass over the pool
    aggregation: str = "awpa"  # awpa | masked (the paper's "w/o AWPA" ablation, FPSL) | samples (plain FedAvg)
    ude: bool = True  # False: the "w/o UDE" ablation (no MixUp rows)
    ue: bool = True  # False: the "w/o UE" ablation (random D^h / D^l, pseudo-labels on every sample)
    pos_weight_mode: str = "element"  # element: pos_weight on every entry, as the code builds it | positive
    repo_compat: bool = False  # the authors' behaviour for spec §5(e)1-2 and their UE formula (see README)
    weak_augment: str = "weak"  # the teacher's view: Resize + horizontal flip (the code's weak view)
    strong_augment: str = "fedlsm_strong"  # the student's view: the code's flips, brightness, blur|noise, affine
    classifier_keys: str = CLASSIFIER_KEYS  # state-dict keys of the classifier rows AWPA weights per class

    def __post_init__(self) -> None:
        problems = [
            (self.aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}"),
            (self.pos_weight_mode in POS_WEIGHT_MODES, f"pos_weight_mode must be one of {POS_WEIGHT_MODES}"),
            (all(0 <= t <= 1 for t in self.thresholds()), "thresholds must be in [0, 1]"),
            (self.tau_neg < self.tau_pos and self.tau_uncertain_neg < self.tau_uncertain_pos,
             "negative thresholds must lie below the positive ones"),
            (self.uncertain_pool > 0 and self.confident_pool > 0, "uncertain_pool and confident_pool must be > 0"),
            (self.mix_batch >= 1 and self.lambda_ude >= 0 and self.mixup_alpha > 0,
             "mix_batch must be >= 1, lambda_ude >= 0 and mixup_alpha > 0"),
            (0 <= self.ema_decay <= 1 and self.local_iterations >= 0, "ema_decay in [0, 1], local_iterations >= 0"),
            (self.weak_augment in AUGMENTATIONS and self.strong_augment in AUGMENTATIONS,
             f"weak_augment and strong_augment must be one of {AUGMENTATIONS}"),
        ]
        failed = [message for ok, message in problems if not ok]
        if failed:
            raise ConfigError("fedlsm: " + "; ".join(failed))

    def thresholds(self) -> tuple[float, ...]:
        """Every pseudo-label threshold (single- and multi-label)."""
        return self.tau, self.tau_uncertain, self.tau_pos, self.tau_neg, self.tau_uncertain_pos, self.tau_uncertain_neg


def check_pool_rows(cfg: FedLsmConfig, trains: Mapping[str, TrainConfig], data: Any) -> list[str]:
    """MethodSpec.check_run: with UDE every batch gives ``mix_batch`` rows to MixUp and needs pseudo-pool rows left
    (each site's trainer would refuse it at its first task)."""
    short = [site for site, train in trains.items() if train.batch_size <= cfg.mix_batch] if cfg.ude else []
    if not short:
        return []
    return [f"train.batch_size at {', '.join(short)} leaves no pseudo-pool rows after method.mix_batch="
            f"{cfg.mix_batch}; raise train.batch_size above {cfg.mix_batch} or lower method.mix_batch"]


SPEC = builtin_method(
    MethodSpec(
        name="fedlsm",
        dp_sgd_blocker=("UDE MixUp blends pairs of private images into one training row and an EMA teacher trained on "
                        "private data pseudo-labels them, so no gradient belongs to one sample"),
        summary="FedLSM: UE pools, EMA-teacher pseudo-labels, UDE MixUp, classifier rows weighted by q (AWPA)",
        config_cls=FedLsmConfig,
        trainer_cls=FedLsmTrainer,
        payload=PAYLOAD,
        server_rule_cls=FedLsmRule,
        train_defaults={"optimizer": "adam", "lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 5e-4, "batch_size": 64},
        reference=REFERENCE,
        multi_label=True,
        check_run=check_pool_rows,
        presets={"paper": PAPER},
        smoke={"data": {"partition": "labelset:3"}, "method_args": {"local_iterations": 2}},
        reveals=("q: per class, how many labels and confident pseudo-labels the site drew this round (its estimated "
                 "class distribution; inherent to AWPA); multi-label jobs also send each class's positive and "
                 "negative label counts once; with aggregation=masked, which classes the site annotates"),
    )
)
