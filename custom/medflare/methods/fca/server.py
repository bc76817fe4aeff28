"""FCA server rule: FedAvg of the shared keys (the personal heads never arrive); FCA's named final figures."""

from medflare.methods.personalization import FiguresRule

__all__ = ["FcaRule"]


class FcaRule(FiguresRule):
    """Sample-count-weighted average of the extractor and the federated head (paper Eq. 6). Final figures:
    generalization = the global model (federated head) on the pooled test splits; specialization = each site's extractor
    and personal head on its own test split, averaged over sites."""
