"""SCAFFOLD (Karimireddy et al. 2020): local SGD steps corrected for client drift by control variates, c − c_i; the
site's own c_i never leaves it, the server's c travels with every train task, Δc_i with every result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from medflare.methods.base import MethodSpec, TrainConfig, builtin_method
from medflare.methods.scaffold.client import ScaffoldTrainer, plain_sgd_problem
from medflare.methods.scaffold.control import PAYLOAD
from medflare.methods.scaffold.server import ScaffoldRule

SUMMARY = "SCAFFOLD: each SGD step corrected by control variates c - c_i (c_i kept at the site), weighted average"
REFERENCE = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"
# plain SGD (the paper's local solver, Algorithm 1); lr 0.01 is medflare's, the paper tunes η_l per experiment
TRAIN_DEFAULTS = {"optimizer": "sgd", "momentum": 0.0, "nesterov": False, "lr": 0.01}


@dataclass
class ScaffoldConfig:
    """SCAFFOLD has no options of its own: η_g is 1 (the weighted average of the weights) and the local solver is the
    job's ``train.*`` SGD."""


def check_plain_sgd(cfg: ScaffoldConfig, trains: Mapping[str, TrainConfig], data: Any) -> list[str]:
    """MethodSpec.check_run: every site trains with plain SGD (no momentum, not Adam), before anything is launched."""
    problems = {site: plain_sgd_problem(train.for_stage("train")) for site, train in trains.items()}
    return [f"scaffold's corrected step y ← y − η_l (g − c_i + c) needs plain SGD, but {site} has {problem}: set "
            "train.optimizer=sgd and train.momentum=0" for site, problem in sorted(problems.items()) if problem]


SPEC = builtin_method(
    MethodSpec(
        name="scaffold",
        summary=SUMMARY,
        config_cls=ScaffoldConfig,
        trainer_cls=ScaffoldTrainer,
        server_rule_cls=ScaffoldRule,
        payload=PAYLOAD,  # the weights y, Δc_i as a declared array; c received as a declared array
        train_defaults=TRAIN_DEFAULTS,
        check_run=check_plain_sgd,
        reference=REFERENCE,
        reveals=("Δc_i = c_i⁺ − c_i, one float per weight: = (x − y_i)/(K η_l) − c, so beside the weights y_i and c "
                 "the server already holds it gives away only K η_l, the round's steps times the learning rate"),
        dp_sgd_blocker=("its correction c − c_i is added to the batch gradient, and DP-SGD replaces that with the "
                        "noised sum of per-sample gradients, so the correction would vanish (and Δc_i is not noised)"),
    )
)
