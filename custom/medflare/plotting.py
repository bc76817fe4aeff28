"""matplotlib set-up shared by every plot medflare draws (run reports, method diagnostics).

A neutral module: methods draw their site-local diagnostics with it without importing the report layer.
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (sites and CI have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def integer_ticks() -> Any:
    """Round axes show whole rounds only."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)
