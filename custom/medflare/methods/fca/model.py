"""The FCA network: one shared feature extractor with two parallel heads, federated and personal."""

from __future__ import annotations

import torch
from torch import nn

from medflare.models import Classifier

__all__ = ["FcaNet", "PERSONAL_HEAD_KEYS"]

#: State-dict keys of the personal head: never sent, never received, not held by the server.
PERSONAL_HEAD_KEYS = r"^personal_head\."


class FcaNet(Classifier):
    """Classifier (``backbone.*``, federated ``head.*``) plus a parallel ``personal_head.*`` of the same shape. Both
    heads read the pooled features after the architecture's classifier dropout (spec §6(a)). ``forward`` uses the
    federated head; the personal head, initialised by each site's own seed, stays at its site."""

    def __init__(self, classifier: Classifier) -> None:
        super().__init__(classifier.backbone, classifier.head, drop_rate=classifier.head_dropout.p)
        self.personal_head = nn.Linear(self.num_features, self.num_classes)

    def forward_both(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(federated logits, personal logits) from one pass through the shared extractor."""
        features = self.forward_head(self.forward_features(images), pre_logits=True)
        return self.head(features), self.personal_head(features)
