"""FedBABU server rule: FedAvg (the frozen head averages to itself); FCA's named final figures."""

from medflare.methods.personalization import FiguresRule

__all__ = ["FedBabuRule"]


class FedBabuRule(FiguresRule):
    """Sample-count-weighted average of every shared key. Generalization = the global body with the shared random head
    on the pooled test splits; specialization = each site's body with a locally fine-tuned head copy on its own test
    split, averaged over sites."""
