"""An exponential-moving-average (mean) teacher of a student network, reusable by any method.

FedLSM (spec §1.6) re-creates it from the freshly loaded global model at the start of every round and updates it
after every optimizer step; Mean-Teacher and FixMatch-style methods use the same object.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["EmaTeacher"]


class EmaTeacher:
    """A frozen, eval-mode copy of a student whose parameters trail the student's.

    After every student step, :meth:`update` sets each parameter to ``decay · teacher + (1 − decay) · student``
    and **copies** every buffer (BatchNorm running statistics, counters) from the student, as FedLSM's authors
    do (``src/model/ema.py``). The teacher is not a submodule of the student, so it never enters the student's
    state dict, optimizer or payload.

    Args:
        student: the network being trained; its current state is the teacher's start.
        decay: the EMA decay d in [0, 1]; 0.999 in FedLSM.
    """

    def __init__(self, student: nn.Module, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(student).eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
            param.grad = None  # deepcopy also copies the student's last gradients

    @torch.no_grad()
    def update(self, student: nn.Module) -> None:
        """One EMA step towards ``student`` (call after its optimizer step)."""
        for teacher_param, student_param in zip(self.model.parameters(), student.parameters()):
            teacher_param.mul_(self.decay).add_(student_param.detach(), alpha=1.0 - self.decay)
        for teacher_buffer, student_buffer in zip(self.model.buffers(), student.buffers()):
            teacher_buffer.copy_(student_buffer)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """The teacher's logits (eval mode, no gradient)."""
        return self.model(images)
