"""FedAvg*'s site update is FedAvg's (loss on the labelled data); it also says which classes it annotates."""

from __future__ import annotations

from typing import Any

from medflare.methods.base import LocalTrainer, RoundContext
from medflare.methods.fedlsm.client import identified_classes
from medflare.methods.fedlsm.server import IDENTIFIED_KEY


class FedAvgMaskedTrainer(LocalTrainer):
    """Cross-entropy (BCE over known entries, multi-label) on labelled data; sends its identified-class mask."""

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        return {IDENTIFIED_KEY: identified_classes(self.data).astype(float).tolist()}
