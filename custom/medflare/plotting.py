"""Every plot medflare draws: the matplotlib set-up (shared with method diagnostics) and a run's figures.

A neutral module: methods draw their site-local diagnostics with :func:`pyplot` without importing the report
layer; ``report`` draws a run's figures with the functions below. Legends sit outside the axes, so they never
cover a curve, and curves that coincide (sites with equal shares or equal values) stay visible. A figure that
shows no data is never written (:func:`save`), so no report embeds an empty plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from medflare.evaluation import headline_metric

DPI = 110
# Marker shapes and line styles that keep coinciding per-site curves apart: each later site draws a smaller
# marker with another dash pattern on top of the earlier ones.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINE_STYLES = ("-", "--", "-.", ":")
PER_SITE_TITLES = {"rf": "rescue factor RF per site"}
CURVE_METRICS = ("balanced_accuracy", "auc_macro_ovr", "accuracy", "macro_f1")  # test curves; the headline first


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


def legend_outside(ax: Any) -> None:
    """The axes' legend to the right of the plot area, where it cannot cover a curve."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def save(fig: Any, path: Path) -> Path | None:
    """Write ``fig`` (legends outside the axes included) and free it; a figure without data is not written
    (None), so an empty plot never reaches a report."""
    try:
        if not has_data(fig):
            return None
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        return path
    finally:
        pyplot().close(fig)


def has_data(fig: Any) -> bool:
    """Whether any axes of ``fig`` shows data: an image, a bar or filled area, or a line with a finite point."""
    for ax in fig.axes:
        if ax.images or ax.patches or any(len(c.get_paths()) for c in ax.collections):
            return True
        if any(_finite(line.get_ydata()) for line in ax.lines):
            return True
    return False


def _finite(values: Sequence[Any]) -> bool:
    """Whether ``values`` hold a finite number (None, as plotted for a missing value, is NaN)."""
    return bool(np.isfinite(np.asarray(values, dtype=float)).any())


# ----- a run's figures -----------------------------------------------------------------------------------
def scored_model(summary: Mapping[str, Any]) -> str:
    """What a run's metrics score: the global model, or the sites' own models where the server holds none."""
    return "global model" if summary.get("server_model", True) else "sites' own models"


def headline(summary: Mapping[str, Any]) -> str:
    """The run's headline metric, which selected its best model (``summary["headline_metric"]``; a summary of an
    earlier version has none: balanced accuracy, the single-label headline, was all it knew)."""
    return summary.get("headline_metric") or headline_metric(multi_label=False)


def scored_rounds(summary: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every round's entry with the model it scored: round 0 (the initial model) when the sites evaluated it,
    then each round of training (``summary["per_round"]``: round r is the model after r rounds)."""
    initial = summary.get("initial_round")
    return ([initial] if initial else []) + list(summary["per_round"])


def learning_curves_figure(summary: Mapping[str, Any]) -> Any:
    """Test metrics (the headline first) and the headline's validation value per round, round 0 included when
    evaluated; each site's mean local training loss. A panel without data is left out."""
    metric, scored = headline(summary), scored_rounds(summary)
    order = [metric] + [m for m in CURVE_METRICS if m != metric]
    curves = [(f"test {m}", [e["metrics"].get(m) for e in scored]) for m in order]
    curves.append((f"val {metric} (selects the best model)", [e["val_metrics"].get(metric) for e in scored]))
    losses = [(site, [e["train_loss"].get(site) for e in summary["per_round"]]) for site in sorted(summary["clients"])]
    panels = []  # (rounds, labelled curves, y label, title) of each panel that has data
    if any(_finite(values) for _, values in curves):
        panels.append(([e["round"] for e in scored], curves, "score",
                       f"{summary['method']}: {scored_model(summary)} after each round"))
    if any(_finite(values) for _, values in losses):
        panels.append(([e["round"] for e in summary["per_round"]], losses, "mean local training loss",
                       "local training loss per site"))
    fig, axes = pyplot().subplots(1, max(len(panels), 1), figsize=(6 * max(len(panels), 1), 4), squeeze=False)
    for ax, (rounds, lines, ylabel, title) in zip(axes[0], panels):
        for i, (label, values) in enumerate(line for line in lines if _finite(line[1])):
            ax.plot(rounds, values, **_site_style(i), label=label)
        ax.set(xlabel="round", ylabel=ylabel, title=title)
        ax.xaxis.set_major_locator(integer_ticks())
        legend_outside(ax)
    fig.tight_layout()
    return fig


def shares_figure(summary: Mapping[str, Any]) -> Any:
    """Each site's share of the aggregate per round, stacked: every site keeps its own band, equal shares too."""
    plt = pyplot()
    rounds = [e["round"] for e in summary["per_round"]]
    sites = sorted(summary["clients"]) or sorted({s for e in summary["per_round"] for s in e.get("share", {})})
    fig, ax = plt.subplots(figsize=(7, 4))
    bands = [[e.get("share", {}).get(site) or 0.0 for e in summary["per_round"]] for site in sites]
    ax.stackplot(rounds, bands, labels=sites, alpha=0.85, edgecolor="white", linewidth=0.8)
    ax.set(xlabel="round", ylabel="share of the aggregate (stacked)", ylim=(0, 1),
           title="contribution of each site to the global model")
    ax.xaxis.set_major_locator(integer_ticks())
    legend_outside(ax)
    fig.tight_layout()
    return fig


def per_site_value_figure(summary: Mapping[str, Any], key: str) -> Any:
    """A per-site value over rounds (e.g. Fed-MAS's RF); coinciding sites stay visible (marker, dash, size)."""
    plt = pyplot()
    rounds = [e["round"] for e in summary["per_round"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, site in enumerate(sorted(summary["clients"])):
        ax.plot(rounds, [e.get(key, {}).get(site) for e in summary["per_round"]], **_site_style(i), label=site)
    ax.set(xlabel="round", ylabel=key, title=PER_SITE_TITLES.get(key, f"{key} per site"))
    ax.xaxis.set_major_locator(integer_ticks())
    legend_outside(ax)
    fig.tight_layout()
    return fig


def per_site_metrics_figure(rows: Mapping[str, Mapping[str, float | None]], metric: str, pooled: float | None,
                            pooled_label: str = "global model, pooled") -> Any:
    """Bars of ``metric`` per site for each evaluated model (global, and any method-declared one)."""
    plt = pyplot()
    models = list(rows)
    sites = sorted({site for per_site in rows.values() for site in per_site})
    width = 0.8 / max(len(models), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(sites) + 3), 4))
    for i, model in enumerate(models):
        values = [rows[model].get(site) or 0.0 for site in sites]
        ax.bar([s + (i - (len(models) - 1) / 2) * width for s in range(len(sites))], values, width=width, label=model)
    if pooled is not None:
        ax.axhline(pooled, color="black", linestyle="--", linewidth=1, label=pooled_label)
    ax.set_xticks(range(len(sites)), sites)
    ax.set(ylabel=f"test {metric}", ylim=(0, 1), title=f"each site's own test split: {metric}")
    legend_outside(ax)
    fig.tight_layout()
    return fig


def confusion_figure(confusion: Sequence[Any], class_names: Sequence[str], model: str = "global model") -> Any:
    """The pooled test confusion matrix of the final model (counts; rows true, columns predicted).

    A multi-label run's confusion is ``[K, 2, 2]``, one binary matrix per finding (known entries only): one panel
    per finding, absent/present.
    """
    import numpy as np
    from sklearn.metrics import ConfusionMatrixDisplay

    plt = pyplot()
    counts = np.asarray(confusion, dtype=np.int64)
    if counts.ndim == 3:
        columns = min(4, len(counts))
        rows = -(-len(counts) // columns)
        fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 3.0 * rows), squeeze=False)
        for ax, matrix, name in zip(axes.flat, counts, class_names):
            ConfusionMatrixDisplay(matrix, display_labels=["absent", "present"]).plot(
                ax=ax, values_format="d", colorbar=False)
            ax.set(title=name)
        for ax in list(axes.flat)[len(counts):]:
            ax.set_axis_off()
        fig.suptitle(f"final {model}, pooled test split, per finding (threshold 0.5)")
        fig.tight_layout()
        return fig
    size = max(4.5, 0.55 * len(class_names) + 2.5)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    display = ConfusionMatrixDisplay(counts, display_labels=list(class_names))
    display.plot(ax=ax, values_format="d", xticks_rotation=45, colorbar=True)
    ax.set(title=f"final {model}, pooled test split")
    fig.tight_layout()
    return fig


def comparison_figure(curves: Mapping[str, Mapping[str, Any]], metric: str) -> Any:
    """Per method: ``metric`` per round (mean, with ± std error bars over seeds) and its final value as a bar.

    Args:
        curves: method -> {"rounds", "mean", "std" (per round), "final_mean", "final_std", "seeds"}.
        metric: the metric shown.
    """
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    for i, (method, c) in enumerate(curves.items()):
        left.errorbar(c["rounds"], c["mean"], yerr=c["std"] if c["seeds"] > 1 else None, capsize=3,
                      **_site_style(i), label=method)
        right.bar(i, c["final_mean"], yerr=c["final_std"] if c["seeds"] > 1 else None, capsize=4)
    seeds = sorted({c["seeds"] for c in curves.values()})
    spread = f"mean ± std over {seeds[0]} seeds" if seeds and seeds[-1] > 1 else "one seed"
    left.set(xlabel="round", ylabel=f"test {metric}", title=f"global model per round ({spread})")
    left.xaxis.set_major_locator(integer_ticks())
    right.set_xticks(range(len(curves)), list(curves), rotation=30, ha="right")
    right.set(ylabel=f"final test {metric}", title="final global model")
    legend_outside(left)
    fig.tight_layout()
    return fig


def _site_style(i: int) -> dict[str, Any]:
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
            "markersize": max(9 - 1.5 * i, 3), "markerfacecolor": "none" if i % 2 == 0 else None}
