"""The Fed-MAS network: the classifier plus a projector into the prior's feature space and an auxiliary head."""

from __future__ import annotations

import torch
from torch import nn

from medflare.models import Classifier


class FedMasNet(Classifier):
    """Classifier (``backbone.*``, ``head.*``, the one used for prediction) with ``projector.*`` (features to the
    prior's dimension D, for the distillation distance) and ``aux_head.*`` (classifies projected features: the
    authors' code, not the paper; it balances projector training, spec §2(e)1), all aggregated like any weight."""

    def __init__(self, classifier: Classifier, prior_dim: int, hidden_dim: int = 0) -> None:
        super().__init__(classifier.backbone, classifier.head, drop_rate=classifier.head_dropout.p)
        hidden = hidden_dim or self.num_features
        self.projector = nn.Sequential(
            nn.Linear(self.num_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, prior_dim)
        )
        self.aux_head = nn.Linear(prior_dim, self.num_classes)

    def forward_train(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(main logits, auxiliary logits, projected features) from one backbone pass."""
        features = self.forward_features(images)
        projected = self.projector(features)
        return self.forward_head(features), self.aux_head(projected), projected
