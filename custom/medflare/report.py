"""Turn the controller's results file into summary.json, a per-round CSV, a markdown report and plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Mapping

from medflare.plotting import integer_ticks, pyplot

TABLE_METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "auc_macro_ovr")
LONG_TAIL_METRICS = ("head_accuracy", "medium_accuracy", "tail_accuracy", "hmt_mean")
ATTRIBUTE_METRICS = ("bacc_attr_0", "bacc_attr_1", "bacc_attr_mean")


def build_summary(
    results: Mapping[str, Any],
    config: Mapping[str, Any],
    clients: Mapping[str, Any],
    launched_at: float | None = None,
) -> dict[str, Any]:
    """The run summary: config, final test metrics, per-round history, per-site facts, payload and timing.

    Args:
        results: the controller's ``medflare_results.json``.
        config: the resolved run configuration.
        clients: per-site facts known to the launcher (simulation: partition sizes and class counts).
        launched_at: epoch seconds when the launcher started FLARE (start-up time = first round start - this).
    """
    rounds = list(results.get("rounds", []))
    evaluations = results.get("evaluations", {})
    per_round = [_round_entry(record, evaluations.get(str(record["round"] + 1), {})) for record in rounds]
    final_eval = results.get("final") or (evaluations.get(str(len(rounds)), {}) if rounds else {})
    return {
        "method": results.get("method", config.get("method")),
        "config": dict(config),
        "rounds_completed": len(rounds),
        "final": final_metrics(final_eval),
        "final_by_attribute": final_eval.get("test_by_attribute", {}),
        "final_val": final_eval.get("val", {}),
        "initial": evaluations.get("0", {}).get("test", {}),
        "best": results.get("best", {}),
        "per_round": per_round,
        "clients": _client_entries(clients, rounds),
        "payload": _payload_entries(rounds),
        "timing": _timing(results, rounds, launched_at),
        "error": results.get("error"),
    }


def final_metrics(evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """The final model's pooled test metrics, plus per-site metrics (``by_site``) and their mean over sites
    (``site_mean``), method-declared evaluations (``extra``) and the method's own named figures."""
    metrics = with_attribute_scores(evaluation)
    metrics.update({key: evaluation[key] for key in ("by_site", "site_mean", "extra") if key in evaluation})
    metrics.update(evaluation.get("method_metrics") or {})
    return metrics


def with_attribute_scores(evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """Test metrics plus balanced accuracy per image attribute (``bacc_attr_<value>``) and their mean.

    The mean over attribute groups is the Fed-MAS paper's ISIC-FL "Avg" (Light, Dark).
    """
    metrics = dict(evaluation.get("test", {}))
    per_attribute = {a: m.get("balanced_accuracy") for a, m in evaluation.get("test_by_attribute", {}).items()}
    if per_attribute and None not in per_attribute.values():
        metrics.update({f"bacc_attr_{a}": v for a, v in per_attribute.items()})
        metrics["bacc_attr_mean"] = sum(per_attribute.values()) / len(per_attribute)
    return metrics


def _round_entry(record: Mapping[str, Any], evaluation: Mapping[str, Any]) -> dict[str, Any]:
    sites = record.get("sites", {})
    entry = {
        "round": record["round"] + 1,
        "metrics": with_attribute_scores(evaluation),
        "val_metrics": evaluation.get("val", {}),
        "by_site": evaluation.get("by_site", {}),
        "wall_seconds": record.get("wall_seconds"),
        "share": record.get("share", {}),
        "train_loss": {site: facts.get("train_loss") for site, facts in sites.items()},
        "rejected": record.get("rejected", {}),
        "failed": record.get("failed", {}),
    }
    known = {"round", "started_at", "failed", "rejected", "payload", "sites", "share", "wall_seconds"}
    entry.update({k: v for k, v in record.items() if k not in known})  # method extras such as "rf"
    return entry


def _client_entries(clients: Mapping[str, Any], rounds: list[Mapping[str, Any]]) -> dict[str, Any]:
    entries = {site: dict(facts) for site, facts in clients.items()}
    for record in rounds:
        for site, facts in record.get("sites", {}).items():
            entry = entries.setdefault(site, {})
            entry["n_samples_reported"] = facts.get("n_samples")
            entry.setdefault("train_seconds", []).append(facts.get("train_seconds"))
            if facts.get("filter_history"):
                entry["filter_history"] = facts["filter_history"]
    return entries


def _payload_entries(rounds: list[Mapping[str, Any]]) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    for record in rounds:
        for site, sent in record.get("payload", {}).items():
            entry = payload.setdefault(site, {"arrays": sent["arrays"], "meta_keys": sent["meta_keys"], "bytes_per_round": []})
            entry["bytes_per_round"].append(sent["bytes"])
    return payload


def _timing(results: Mapping[str, Any], rounds: list[Mapping[str, Any]], launched_at: float | None) -> dict[str, Any]:
    per_round = [r.get("wall_seconds") for r in rounds]
    first_start = rounds[0]["started_at"] if rounds else None
    timing = {
        "per_round_seconds": per_round,
        "mean_round_seconds": sum(per_round) / len(per_round) if per_round else None,
        "final_validation_seconds": results.get("final_validation", {}).get("wall_seconds"),
    }
    if launched_at is not None and first_start is not None:
        timing["startup_seconds"] = first_start - launched_at
    if launched_at is not None and results.get("finished_at"):
        timing["total_seconds"] = results["finished_at"] - launched_at
    return timing


def write_outputs(summary: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """summary.json, rounds.csv, report.md and PNG plots in ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "summary.json", out / "rounds.csv", out / "report.md"]
    files[0].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    _write_rounds_csv(summary, files[1])
    files[2].write_text(markdown_report(summary))
    files.extend(write_plots(summary, out))
    return files


def _write_rounds_csv(summary: Mapping[str, Any], path: Path) -> None:
    sites = sorted(summary.get("clients", {}))
    header = ["round", "wall_seconds"] + [f"test_{m}" for m in TABLE_METRICS] + [f"val_{m}" for m in TABLE_METRICS]
    header += [f"share_{s}" for s in sites] + [f"train_loss_{s}" for s in sites]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for entry in summary["per_round"]:
            row = [entry["round"], _fmt(entry.get("wall_seconds"))]
            row += [_fmt(entry["metrics"].get(m)) for m in TABLE_METRICS]
            row += [_fmt(entry["val_metrics"].get(m)) for m in TABLE_METRICS]
            row += [_fmt(entry["share"].get(s)) for s in sites] + [_fmt(entry["train_loss"].get(s)) for s in sites]
            writer.writerow(row)


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def metric_columns(final: Mapping[str, Any]) -> list[str]:
    """The metrics shown in tables: the standard four, plus head/medium/tail and per-attribute ones when present."""
    return [m for m in TABLE_METRICS + LONG_TAIL_METRICS + ATTRIBUTE_METRICS if m in final]


def results_table(summaries: list[Mapping[str, Any]]) -> str:
    """A markdown table of final test metrics, one row per run."""
    if not summaries:
        return ""
    columns = metric_columns(summaries[0]["final"])
    lines = ["| method | rounds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for s in summaries:
        values = " | ".join(_cell(s["final"].get(c)) for c in columns)
        lines.append(f"| {s['method']} | {s['rounds_completed']} | {values} |")
    return "\n".join(lines)


def format_seconds(value: float | None, digits: int) -> str:
    """Seconds with `digits` decimals, or n/a when unknown (e.g. the start-up of a job launched elsewhere)."""
    return "n/a" if value is None else f"{value:.{digits}f} s"


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a"


def markdown_report(summary: Mapping[str, Any]) -> str:
    """A short human-readable report of one run."""
    cfg = summary["config"]
    timing = summary["timing"]
    lines = [
        f"# medflare run: {summary['method']}",
        "",
        f"- data: `{cfg.get('data', {}).get('source')}` partition `{cfg.get('data', {}).get('partition', '-')}`, "
        f"{cfg.get('clients')} sites, model `{cfg.get('model')}`, {summary['rounds_completed']} rounds, seed {cfg.get('seed')}",
        f"- mean round wall time {format_seconds(timing.get('mean_round_seconds'), 2)}; "
        f"start-up {format_seconds(timing.get('startup_seconds'), 1)}",
        "- metrics are of the global model on the sites' held-out test splits, summed as confusion counts "
        "(exact pooled values); the best model is chosen on validation only",
        "",
        "## Final test metrics",
        "",
        results_table([summary]),
        "",
        "## Sites",
        "",
        "| site | train samples | bytes sent per round |",
        "|---|---|---|",
    ]
    for site, facts in sorted(summary["clients"].items()):
        sent = summary["payload"].get(site, {}).get("bytes_per_round", [])
        lines.append(f"| {site} | {facts.get('n_train', facts.get('n_samples_reported'))} | {sent[-1] if sent else '-'} |")
    if summary.get("error"):
        lines += ["", f"**The job failed:** {summary['error']}"]
    lines += ["", "Plots: `learning_curves.png`, `shares.png`.", ""]
    return "\n".join(lines)


def write_plots(summary: Mapping[str, Any], out: Path) -> list[Path]:
    """Learning curves, each site's share of the aggregate, and any other per-site value (e.g. RF) over rounds."""
    plt = pyplot()

    rounds = [e["round"] for e in summary["per_round"]]
    if not rounds:
        return []
    files = [out / "learning_curves.png"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for metric in ("balanced_accuracy", "accuracy", "macro_f1"):
        axes[0].plot(rounds, [e["metrics"].get(metric) for e in summary["per_round"]], marker="o", label=f"test {metric}")
    axes[0].plot(rounds, [e["val_metrics"].get("balanced_accuracy") for e in summary["per_round"]], "--", label="val balanced_accuracy")
    axes[0].set(xlabel="round", ylabel="score", title=f"{summary['method']}: global model")
    axes[0].legend(fontsize=8)
    for site in sorted(summary["clients"]):
        axes[1].plot(rounds, [e["train_loss"].get(site) for e in summary["per_round"]], marker=".", label=site)
    axes[1].set(xlabel="round", ylabel="mean local training loss", title="local training loss per site")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.xaxis.set_major_locator(integer_ticks())
    fig.tight_layout()
    fig.savefig(files[0], dpi=110)
    plt.close(fig)
    for key in ["share"] + [k for k in site_valued_keys(summary["per_round"]) if k not in ("share", "train_loss")]:
        files.append(out / ("shares.png" if key == "share" else f"{key}.png"))
        _plot_per_site(plt, summary, key, files[-1])
    return files


PER_SITE_TITLES = {"share": "contribution of each site to the global model", "rf": "rescue factor RF per site"}


def site_valued_keys(per_round: list[Mapping[str, Any]]) -> list[str]:
    """Per-round entries that map each site to a number (shares, RF, ...), in first-seen order."""
    keys: list[str] = []
    for entry in per_round:
        for key, value in entry.items():
            numeric = isinstance(value, dict) and value and all(isinstance(v, (int, float)) for v in value.values())
            if numeric and key not in keys:
                keys.append(key)
    return keys


def _plot_per_site(plt: Any, summary: Mapping[str, Any], key: str, path: Path) -> None:
    rounds = [e["round"] for e in summary["per_round"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for site in sorted(summary["clients"]):
        ax.plot(rounds, [e.get(key, {}).get(site) for e in summary["per_round"]], marker="o", label=site)
    ax.set(xlabel="round", ylabel=key, title=PER_SITE_TITLES.get(key, f"{key} per site"))
    ax.xaxis.set_major_locator(integer_ticks())
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def comparison_outputs(summaries: list[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """comparison.md (final metrics table) and comparison.png (test balanced accuracy per round per method)."""
    plt = pyplot()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table_file, plot_file = out / "comparison.md", out / "comparison.png"
    table_file.write_text("# Method comparison (test split of every site, pooled)\n\n" + results_table(summaries) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        rounds = [e["round"] for e in s["per_round"]]
        ax.plot(rounds, [e["metrics"].get("balanced_accuracy") for e in s["per_round"]], marker="o", label=s["method"])
    ax.set(xlabel="round", ylabel="test balanced accuracy", title="global model per round")
    ax.xaxis.set_major_locator(integer_ticks())
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_file, dpi=110)
    plt.close(fig)
    return [table_file, plot_file]
