"""Test-only plugin: two stages with a stage-dependent key set, a private head, and a site-declared evaluation.

Stage "warmup" (2 rounds, not scored) sends every shared key; stage "main" (the rest) stops sending the first
convolution ("backbone.0."). The head is private: it never leaves a site and is never received. Each site
records the counters of every task and the keys it received, and declares an extra evaluation "own" (its own
model, head included, on its own split).
"""

from __future__ import annotations

from dataclasses import dataclass

from medflare.contracts import Payload
from medflare.methods.base import LocalTrainer, MethodSpec, ServerRule, Stage
from medflare.registry import register_method


@dataclass
class StagedConfig:
    warmup_rounds: int = 2


class StagedTrainer(LocalTrainer):
    def receive(self, arrays):
        self.record_locally(event="receive", keys=sorted(arrays))
        super().receive(arrays)

    def on_round_start(self, ctx):
        self.record_locally(
            event="round", round=ctx.round, stage=ctx.stage, stage_round=ctx.stage_round,
            stage_rounds=ctx.stage_rounds, scored=ctx.scored, total_rounds=ctx.total_rounds,
        )

    def extra_evaluations(self, split):
        return {"own": self.evaluate(split)}


class StagedRule(ServerRule):
    def stages(self):
        return [Stage("warmup", self.cfg.warmup_rounds, scored=False), Stage("main", self.total_rounds - self.cfg.warmup_rounds)]


register_method(
    MethodSpec(
        name="test-staged",
        summary="test-only: two stages, private head, extra evaluation",
        config_cls=StagedConfig,
        trainer_cls=StagedTrainer,
        payload=Payload(private_keys=r"^head\.", stage_excluded_keys={"main": r"^backbone\.0\."}),
        server_rule_cls=StagedRule,
        reference="test",
    )
)
