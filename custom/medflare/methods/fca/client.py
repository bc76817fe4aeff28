"""FCA site update: both heads on the site's data, the personal head anchoring the federated one."""

from __future__ import annotations

from typing import Any

import torch

from medflare.evaluation import SPECIALIZATION
from medflare.methods.fca.loss import fca_loss
from medflare.methods.personalization import PersonalizedTrainer

__all__ = ["FcaTrainer"]


class FcaTrainer(PersonalizedTrainer):
    """``λ₁·BSM(federated) + λ₂·BSM(personal) + KL(p_personal ‖ p_federated)`` with a stop-gradient into the
    personal head; evaluation of the global model uses the federated head, the specialization evaluation the
    personal head.

    The personal head is a private key: :meth:`receive` never overwrites it, it is never sent, and it is saved
    with the optimizer in the site's state after every task, so a restarted site continues with its own head.

    References:
        Wicaksana, Yan and Cheng, FCA: Taming Long-tailed Federated Medical Image Classification by Classifier
        Anchoring, 2023.
    """

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        fed_logits, personal_logits = self.model.forward_both(images)
        cfg = self.cfg
        return fca_loss(
            fed_logits[labelled], personal_logits[labelled], labels[labelled], self.class_counts,
            lambda_fed=cfg.lambda_fed, lambda_personal=cfg.lambda_personal, consistency_weight=cfg.consistency_weight,
            consistency=cfg.consistency, temperature=cfg.temperature, eps=cfg.eps,
        )

    def extra_evaluations(self, split: str) -> dict[str, Any]:
        """Specialization: this site's extractor and personal head as its last local training left them."""
        return {SPECIALIZATION: self.evaluate_with_head(self.model.personal_head, split)}
