"""FedAvg's site update is the shared loop with plain cross-entropy."""

from medflare.methods.base import LocalTrainer


class FedAvgTrainer(LocalTrainer):
    """Cross-entropy on the site's labelled samples (the LocalTrainer default)."""
