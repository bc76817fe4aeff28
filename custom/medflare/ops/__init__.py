"""Pure numpy operations on name -> array dictionaries (no FLARE, no torch training)."""

from medflare.ops.aggregate import cap_shares, normalise_weights, weighted_average
from medflare.ops.state import load_params, model_params

__all__ = ["cap_shares", "normalise_weights", "weighted_average", "load_params", "model_params"]
