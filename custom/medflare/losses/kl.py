"""KL distillation from a teacher's probabilities to a student's logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.errors import DataError

__all__ = ["kl_to_teacher"]


def kl_to_teacher(student_logits: torch.Tensor, teacher_probs: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``KL(teacher ‖ student)`` averaged over the batch: ``kl_div(log_softmax(z/T), q, 'batchmean')``.

    The caller detaches ``teacher_probs`` (used as given, rows summing to 1); ``temperature`` divides the student
    logits only, with no T² factor (MDH-FL and FCA use T = 1). DataError when the shapes differ.

    References:
        Hinton et al., Distilling the Knowledge in a Neural Network, 2015.
    """
    if student_logits.shape != teacher_probs.shape:
        raise DataError(
            f"student logits {list(student_logits.shape)} and teacher probs {list(teacher_probs.shape)} differ in shape"
        )
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    return F.kl_div(log_student, teacher_probs.to(log_student.dtype), reduction="batchmean")
