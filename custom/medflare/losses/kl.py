"""KL distillation from a teacher's probabilities to a student's logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.errors import DataError

__all__ = ["kl_to_teacher"]


def kl_to_teacher(student_logits: torch.Tensor, teacher_probs: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``KL(teacher ‖ student)`` averaged over the batch: ``kl_div(log_softmax(z/T), q, 'batchmean')``.

    The gradient flows into the student only if ``teacher_probs`` is detached by the caller (or has no graph).
    No T² factor is applied: MDH-FL and FCA use T = 1. ``teacher_probs`` are used as given (already softened if
    the caller wants a temperature on the teacher too).

    Args:
        student_logits: raw student logits ``[B, K]``.
        teacher_probs: teacher probabilities ``[B, K]``, rows summing to 1.
        temperature: divides the student logits.

    Raises:
        DataError: if the shapes differ.

    References:
        Hinton et al., Distilling the Knowledge in a Neural Network, 2015.
    """
    if student_logits.shape != teacher_probs.shape:
        raise DataError(
            f"student logits {list(student_logits.shape)} and teacher probs {list(teacher_probs.shape)} differ in shape"
        )
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    return F.kl_div(log_student, teacher_probs.to(log_student.dtype), reduction="batchmean")
