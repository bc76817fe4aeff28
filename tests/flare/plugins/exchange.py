"""Test-only plugin: a two-phase round whose second phase sends each site its own array.

Phase "share": every site sends softmax probabilities of its model on its first ``ROWS`` training images
(a declared fp16 array). Phase "train": the server sends each site, besides the global weights, a "target"
built only from the *other* sites' probabilities, plus the site's own index, so each site's array is
different; the site records the sum of what it received and sends it back as meta.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from medflare.contracts import Payload, non_negative_number, probabilities
from medflare.methods.base import LocalTrainer, MethodSpec, PerSite, ServerRule
from medflare.registry import register_method

ROWS = 8


@dataclass
class ExchangeConfig:
    pass


class ExchangeTrainer(LocalTrainer):
    def run_phase(self, phase, arrays, ctx):
        self.model.eval()
        images = torch.stack([self.data.train[i][0] for i in range(ROWS)]).to(self.device)
        with torch.no_grad():
            probs = torch.softmax(self.model(images).float(), dim=1).cpu().numpy()
        return {"probs": probs.astype(np.float16)}, {}

    def round_meta(self, ctx):
        received = float(self.received["target"].astype(np.float64).sum())
        self.record_locally(round=ctx.round, target_sum=received)
        return {"target_sum": received}


class ExchangeRule(ServerRule):
    def phases(self, ctx):
        return ["share", "train"]

    def array_dims(self, phase, ctx):
        return {"rows": ROWS}

    def phase_arrays(self, phase, ctx, global_params, earlier):
        if phase != "train":
            return {}
        weights = super().phase_arrays(phase, ctx, global_params, earlier)
        probs = {u.site: u.arrays["probs"].astype(np.float32) for u in earlier["share"]}
        targets = {
            site: np.mean([p for s, p in probs.items() if s != site] or [np.zeros_like(probs[site])], axis=0) + index
            for index, site in enumerate(sorted(probs))
        }
        self.sent = {site: float(t.astype(np.float64).sum()) for site, t in targets.items()}
        return PerSite({site: {**weights, "target": t.astype(np.float32)} for site, t in targets.items()})

    def round_info(self, updates, ctx):
        return {"target_sums_sent": dict(self.sent)}


register_method(
    MethodSpec(
        name="test-exchange",
        summary="test-only: two phases, per-site targets",
        config_cls=ExchangeConfig,
        trainer_cls=ExchangeTrainer,
        payload=Payload(
            arrays={"probs": probabilities(phase="share")},
            receives=("target",),
            meta={"target_sum": non_negative_number("target_sum")},
        ),
        server_rule_cls=ExchangeRule,
        reference="test",
    )
)
