"""The one model interface every registered network is wrapped in: backbone -> pooled features -> linear head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Classifier", "CosineLinear"]


class Classifier(nn.Module):
    """Uniform interface: a backbone mapping images to pooled features, then one linear head.

    Whatever the architecture, the state-dict keys are ``backbone.*`` and ``head.*``, so methods that split the
    model (FedRep, FCA's personalised head, FedLSM's per-row classifier aggregation) never depend on layer
    names. Methods that need more modules (a projector, a second head) subclass this or wrap it and add them
    as siblings, e.g. ``projector.*`` or ``personal_head.*``; :meth:`forward_features` and
    :meth:`forward_head` with ``pre_logits=True`` give them the shared features.

    Attributes:
        backbone: maps ``[B, C, H, W]`` images to ``[B, num_features]`` pooled features.
        head: the classifier, ``Linear(num_features, num_classes)``.
        head_dropout: dropout applied to the features before the head (the architecture's own classifier
            dropout, e.g. 0.2 for EfficientNet; identity when 0). It has no parameters.
        num_features: width of the pooled features.
        num_classes: number of output logits.

    References:
        timm's model interface (``forward_features``, ``forward_head``, ``reset_classifier``):
        https://github.com/huggingface/pytorch-image-models
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear, drop_rate: float = 0.0) -> None:
        """Wrap a backbone and a head.

        Args:
            backbone: module returning pooled features of width ``head.in_features``.
            head: linear classifier; it is used as given, so a library's own head initialisation is kept.
            drop_rate: dropout probability on the features before the head.
        """
        super().__init__()
        self.backbone = backbone
        self.head_dropout = nn.Dropout(drop_rate)
        self.head = head
        self.num_features = head.in_features
        self.num_classes = head.out_features

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled features ``[B, num_features]``."""
        return self.backbone(x)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Logits from pooled features, or the features as the head sees them (after dropout) if ``pre_logits``."""
        features = self.head_dropout(features)
        return features if pre_logits else self.head(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_classes]``."""
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Linear:
        """The linear head."""
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head by a freshly initialised ``Linear(num_features, num_classes)`` on the same device."""
        old = self.head
        self.head = nn.Linear(self.num_features, num_classes, device=old.weight.device, dtype=old.weight.dtype)
        self.num_classes = num_classes


class CosineLinear(nn.Linear):
    """A bias-free linear head whose logits are cosines between the features and the class weight rows.

    Drop-in for ``Classifier.head`` (same ``weight`` key and shape) when a loss expects cosine logits in
    [-1, 1], such as LDAM.

    References:
        Cao et al., Learning Imbalanced Datasets with Label-Distribution-Aware Margin Loss, NeurIPS 2019.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        """Create the head; like ``nn.Linear`` but without bias."""
        super().__init__(in_features, out_features, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Cosine logits ``[B, out_features]``."""
        return F.linear(F.normalize(features, dim=1), F.normalize(self.weight, dim=1))
