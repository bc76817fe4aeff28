"""FCA's local objective: balanced softmax on both heads plus consistency from the personal to the federated head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.losses import balanced_softmax_loss, kl_to_teacher
from medflare.losses._counts import CountsLike

__all__ = ["CONSISTENCY_MODES", "REPO_INPUT_EPS", "consistency_loss", "fca_loss"]

CONSISTENCY_MODES = ("kl", "repo")
REPO_INPUT_EPS = 1e-11  # the notebook adds it to the probabilities it passes as KLDivLoss's "log" input


def consistency_loss(fed_logits: torch.Tensor, personal_logits: torch.Tensor, mode: str = "kl",
                     temperature: float = 1.0) -> torch.Tensor:
    """L_con from the personal head (teacher, detached: no gradient reaches it) to the federated head ``[B, K]``. ``kl``
    (the paper, spec §6(e)1): ``KL(p_personal ‖ p_federated)``, batch mean, both softened by T. ``repo`` (the authors'
    notebook): ``nn.KLDivLoss()`` fed probabilities instead of log-probabilities, with the legacy element-wise mean over
    B×C: ``mean(t · (log t − (s + 1e-11)))`` with t = p_personal, s = p_federated. It is a bounded inner-product reward,
    not a divergence, and 1/C the scale of a batch-mean KL."""
    teacher = F.softmax(personal_logits.detach() / temperature, dim=1)
    if mode == "kl":
        return kl_to_teacher(fed_logits, teacher, temperature)
    student = F.softmax(fed_logits / temperature, dim=1) + REPO_INPUT_EPS
    return (torch.xlogy(teacher, teacher) - teacher * student).mean()


def fca_loss(fed_logits: torch.Tensor, personal_logits: torch.Tensor, targets: torch.Tensor, class_counts: CountsLike,
             *, lambda_fed: float, lambda_personal: float, consistency_weight: float, consistency: str,
             temperature: float, eps: float) -> torch.Tensor:
    """``λ₁·BSM(z_fed) + λ₂·BSM(z_personal) + w·L_con(z_fed ← z_personal)`` (paper Eq. 5; w = 1 there). BSM uses the
    site's own class prior π_k (counts / total, + eps). The personal head is trained only by its own BSM term; the
    consistency term moves the federated head and the shared extractor."""
    loss = lambda_fed * balanced_softmax_loss(fed_logits, targets, class_counts, eps=eps)
    loss = loss + lambda_personal * balanced_softmax_loss(personal_logits, targets, class_counts, eps=eps)
    if consistency_weight == 0:
        return loss
    return loss + consistency_weight * consistency_loss(fed_logits, personal_logits, consistency, temperature)
