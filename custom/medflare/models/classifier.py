"""The one model interface every registered network is wrapped in: backbone -> pooled features -> linear head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Classifier", "CosineLinear"]


class Classifier(nn.Module):
    """A backbone mapping ``[B, C, H, W]`` images to ``[B, num_features]`` pooled features, the architecture's own
    classifier dropout (``head_dropout``, no parameters) and one ``Linear(num_features, num_classes)`` head (timm's
    model interface).

    The state-dict keys are ``backbone.*`` and ``head.*`` whatever the architecture, so methods that split the
    model never depend on layer names; extra modules are siblings (``projector.*``, ``personal_head.*``) that
    take the shared features from :meth:`forward_head` with ``pre_logits=True``.
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear, drop_rate: float = 0.0) -> None:
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
    """A bias-free linear head whose logits are cosines between the features and the class weight rows: a
    drop-in ``Classifier.head`` for losses that expect logits in [-1, 1], such as LDAM (Cao et al., NeurIPS 2019)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Cosine logits ``[B, out_features]``."""
        return F.linear(F.normalize(features, dim=1), F.normalize(self.weight, dim=1))
