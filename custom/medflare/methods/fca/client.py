"""FCA site update: both heads on the site's data, the personal head anchoring the federated one."""

from __future__ import annotations

from typing import Any

import torch

from medflare.evaluation import SPECIALIZATION
from medflare.methods.fca.loss import fca_loss
from medflare.methods.personalization import PersonalizedTrainer

__all__ = ["FcaTrainer"]


class FcaTrainer(PersonalizedTrainer):
    """``λ₁·BSM(federated) + λ₂·BSM(personal) + KL(p_personal ‖ p_federated)`` with a stop-gradient into the personal
    head; the global model is evaluated with the federated head, the specialization with the personal one. The
    personal head is a private key: never overwritten by :meth:`receive`, never sent, and saved in the site's state
    after every task, so a restarted site continues with its own head."""

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
