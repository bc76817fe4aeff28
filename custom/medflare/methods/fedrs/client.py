"""FedRS site update: the site's logits of classes it lacks are scaled down before the (balanced) softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare.losses import balanced_softmax_loss, restricted_logits
from medflare.methods.base import LocalTrainer

__all__ = ["FedRsTrainer"]


class FedRsTrainer(LocalTrainer):
    """Loss = BSM (or CE) on ``α_c · z_c``: α_c = ``alpha + (1 − alpha)·n_c / max n`` (soft, the authors' code) or 1 for
    a class the site has and ``alpha`` for one it lacks (hard, the paper). Only the local loss sees the restriction;
    prediction uses the raw logits. A missing (or rare) class's weight vector is then pulled less towards the site's
    features. With balanced softmax the missing classes' logits already carry a log(eps) offset, so hard + BSM trains as
    BSM-FL (README). The class counts never leave the site."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labelled = labels >= 0
        cfg = self.cfg
        logits = restricted_logits(self.model(images)[labelled], self.class_counts, cfg.alpha, cfg.restriction)
        if cfg.loss == "bsm":
            return balanced_softmax_loss(logits, labels[labelled], self.class_counts, eps=cfg.eps)
        return F.cross_entropy(logits, labels[labelled])
