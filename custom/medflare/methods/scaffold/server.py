"""scaffold's server rule: how the sites' updates become the next global model (pure numpy)."""

from medflare.methods.base import ServerRule


class ScaffoldRule(ServerRule):
    """Sample-count-weighted average of every shared weight (ServerRule's FedAvg). Override ``site_weight`` for
    another scalar weight per site, ``row_weights`` for per-class rows, ``phases`` for several tasks a round."""
