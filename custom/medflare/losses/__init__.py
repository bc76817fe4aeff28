"""Training losses shared by the methods; one loss per module.

Plain cross-entropy is ``torch.nn.functional.cross_entropy`` and is not wrapped here.
"""

from medflare.losses.balanced_softmax import balanced_softmax_loss
from medflare.losses.class_weights import class_balanced_weights, drw_class_weights, inverse_effective_number
from medflare.losses.focal import focal_loss
from medflare.losses.kl import kl_to_teacher
from medflare.losses.ldam import LDAMLoss
from medflare.losses.logit_calibration import logit_calibrated_ce
from medflare.losses.multi_label import masked_bce, weighted_bce
from medflare.losses.proximal import proximal_term
from medflare.losses.restricted_softmax import restricted_logits, restricted_softmax_loss, restriction_scales
from medflare.losses.symmetric_ce import symmetric_cross_entropy

__all__ = [
    "LDAMLoss",
    "balanced_softmax_loss",
    "class_balanced_weights",
    "drw_class_weights",
    "focal_loss",
    "inverse_effective_number",
    "kl_to_teacher",
    "logit_calibrated_ce",
    "masked_bce",
    "proximal_term",
    "restricted_logits",
    "restricted_softmax_loss",
    "restriction_scales",
    "symmetric_cross_entropy",
    "weighted_bce",
]
