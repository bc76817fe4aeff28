"""Site-local Fed-MAS diagnostics as a picture: w̄ and ŵ̄ per class, and RF over rounds (never sent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from medflare.plotting import integer_ticks, pyplot


def plot_divergence(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars of normalised w and ŵ per class in the last round, and the site's RF per round."""
    records = [r for r in records if "w" in r and "w_hat" in r]
    if not records:
        return None
    plt = pyplot()

    last = records[-1]
    w, w_hat = np.asarray(last["w"], float), np.asarray(last["w_hat"], float)
    classes = np.arange(len(w))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.bar(classes - 0.2, w / max(w.sum(), 1e-12), width=0.4, label="w̄ (global model, before training)")
    left.bar(classes + 0.2, w_hat / max(w_hat.sum(), 1e-12), width=0.4, label="ŵ̄ (during local training)")
    left.set(xlabel="class", ylabel="normalised distance to the prior", title=f"round {last['round'] + 1}")
    left.legend(fontsize=8)
    right.plot([r["round"] + 1 for r in records], [r["rf"] for r in records], marker="o")
    right.set(xlabel="round", ylabel="RF", title="this site's rescue factor")
    right.xaxis.set_major_locator(integer_ticks())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
