"""FedRS server rule: FedAvg; FCA's named final figures (its sites keep the global model)."""

from medflare.methods.personalization import FiguresRule

__all__ = ["FedRsRule"]


class FedRsRule(FiguresRule):
    """Sample-count-weighted average of every shared key. One model serves everyone, so generalization = the global
    model on the pooled test splits and specialization = the same global model on each site's own test split, averaged
    over sites (``final.site_mean``)."""

    specialization = None
