"""Turn the controller's results file into summary.json, a per-round CSV, a markdown report and plots. Round r is the
global model after r rounds (round 0: the initial model, when the sites scored it); the headline metric is the one the
controller selected the best model by; start-up is seconds from the launch to the first round (:func:`_timing`)."""

from __future__ import annotations

import csv
import json
import statistics
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from medflare import plotting, readback
from medflare.contracts import DP_EPSILON
from medflare.errors import ConfigError
from medflare.evaluation import metric_name, selection_metric

TABLE_METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "auc_macro_ovr")
LONG_TAIL_METRICS = ("head_accuracy", "medium_accuracy", "tail_accuracy", "hmt_mean")
ATTRIBUTE_METRICS = ("bacc_attr_0", "bacc_attr_1", "bacc_attr_mean")


def read_results(path: Path) -> dict[str, Any]:
    """A controller's ``medflare_results.json`` read back (depth-limited, held to :data:`readback.RESULTS`).

    Raises:
        ConfigError: one line naming the file and the first field that is missing or of the wrong type.
    """
    fix = f"{readback.CHANGED}; report on the file as medflare wrote it (e.g. a fresh download of the job)"
    return readback.check(readback.load_json(path, ConfigError, fix=fix), readback.RESULTS, str(path), ConfigError, fix)


def build_summary(
    results: Mapping[str, Any],
    config: Mapping[str, Any],
    clients: Mapping[str, Any],
    launched_at: float | None = None,
) -> dict[str, Any]:
    """The run summary: config, final test metrics, per-round history, per-site facts, payload and timing.
    ``clients``: per-site facts the launcher knows (simulation: partition sizes, class counts); ``launched_at``:
    epoch seconds when medflare launched FLARE (None: launched elsewhere)."""
    rounds = list(results.get("rounds", []))
    evaluations = results.get("evaluations", {})
    final_eval = results.get("final") or (evaluations.get(str(len(rounds)), {}) if rounds else {})
    return {
        "method": results.get("method", config.get("method")),
        "server_model": bool(config.get("server_model", True)),
        "headline_metric": selection_metric(results, bool((config.get("task") or {}).get("multi_label"))),
        "config": dict(config),
        "rounds_completed": len(rounds),
        "final": final_metrics(final_eval),
        "final_confusion": (final_eval.get("test_stats") or {}).get("confusion"),
        "final_by_attribute": final_eval.get("test_by_attribute", {}),
        "final_val": final_eval.get("val", {}),
        "initial": evaluations.get("0", {}).get("test", {}),
        **({"initial_round": _scored_entry(0, evaluations["0"])} if "0" in evaluations else {}),
        "best": results.get("best", {}),
        "per_round": [_round_entry(record, evaluations.get(str(record["round"] + 1), {})) for record in rounds],
        "clients": _client_entries(clients, rounds),
        "payload": _payload_entries(rounds),
        "timing": _timing(results, rounds, launched_at),
        "error": results.get("error"),
        "stopped_early": results.get("stopped_early"),
        "plan": results.get("plan"),  # the fingerprint of the plan the server ran (each site logs its own)
        "resumed": results.get("resumed", []),  # the jobs (or folders) this one continued, in order
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


def _scored_entry(model_round: int, evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """What the sites scored of the model after ``model_round`` rounds: pooled test and validation metrics,
    per site and their mean over sites; no training (round 0, the initial model, has none)."""
    return {
        "round": model_round,
        "metrics": with_attribute_scores(evaluation),
        "val_metrics": evaluation.get("val", {}),
        "by_site": evaluation.get("by_site", {}),
        "site_mean": evaluation.get("site_mean", {}),
        "wall_seconds": None, "share": {}, "train_loss": {},
    }


def _round_entry(record: Mapping[str, Any], evaluation: Mapping[str, Any]) -> dict[str, Any]:
    sites = record.get("sites", {})
    entry = {
        **_scored_entry(record["round"] + 1, evaluation),
        "wall_seconds": record.get("wall_seconds"),
        "share": record.get("share", {}),
        "train_loss": {site: facts.get("train_loss") for site, facts in sites.items()},
        "rejected": record.get("rejected", {}),
        "failed": record.get("failed", {}),
    }
    epsilon = {site: facts[DP_EPSILON] for site, facts in sites.items() if DP_EPSILON in facts}
    if epsilon:  # DP-SGD: ε each site has spent after this round (plotted per site like RF)
        entry[DP_EPSILON] = epsilon
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
            if DP_EPSILON in facts:  # ε after each round this site trained (DP-SGD)
                entry.setdefault(DP_EPSILON, []).append(facts[DP_EPSILON])
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
    """Round walls, and the start-up: seconds from the run's launch (``launched_at``, when medflare started FLARE;
    for a job launched elsewhere the server app's start, ``startup_from`` "server") to its first round (a resumed
    job's: the first one it ran)."""
    per_round = [r.get("wall_seconds") for r in rounds]
    resumed_at = ((results.get("resumed") or [{}])[-1]).get("start_round", 0)  # the round this job began with
    resumed_at = resumed_at if isinstance(resumed_at, int) and resumed_at >= 0 else 0
    first_start = rounds[resumed_at]["started_at"] if resumed_at < len(rounds) else None
    timing: dict[str, Any] = {
        "per_round_seconds": per_round,
        "mean_round_seconds": sum(per_round) / len(per_round) if per_round else None,
        "final_validation_seconds": results.get("final_validation", {}).get("wall_seconds"),
        "launched_at": launched_at,
    }
    start, timing["startup_from"] = ((launched_at, "launch") if launched_at is not None
                                     else (results.get("controller_started_at"), "server"))
    if start is not None and first_start is not None:
        timing["startup_seconds"] = first_start - start
    if start is not None and results.get("finished_at"):
        timing["total_seconds"] = results["finished_at"] - start
    return timing


def startup_text(timing: Mapping[str, Any]) -> str:
    """``start-up 17.1 s``, saying so when it counts from the server app's start instead of the launch."""
    text = f"start-up {format_seconds(timing.get('startup_seconds'), 1)}"
    if timing.get("startup_from") == "server" and timing.get("startup_seconds") is not None:
        text += " (from the server app's start: the job was launched elsewhere)"
    return text


def write_outputs(summary: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """summary.json, rounds.csv, PNG plots and report.md (showing every plot in ``out_dir``); returns the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "summary.json", out / "rounds.csv"]
    files[0].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    _write_rounds_csv(summary, files[1])
    files.extend(write_plots(summary, out))
    files.append(out / "report.md")
    files[-1].write_text(markdown_report(summary, plots=run_plots(out)))
    return files


def _write_rounds_csv(summary: Mapping[str, Any], path: Path) -> None:
    """One row per scored round: its stage (staged methods), pooled test metrics (head/medium/tail and per-attribute
    ones when present), their unweighted mean over sites (``test_site_mean_*``), pooled validation metrics, each
    site's share and loss."""
    sites = sorted(summary.get("clients", {}))
    rows = plotting.scored_rounds(summary)
    staged = any("stage" in entry for entry in rows)
    tested = metric_columns(*(entry["metrics"] for entry in rows))
    site_mean = metric_columns(*(entry.get("site_mean", {}) for entry in rows))
    header = ["round"] + (["stage"] if staged else []) + ["wall_seconds"]
    header += [f"test_{m}" for m in tested] + [f"test_site_mean_{m}" for m in site_mean]
    header += [f"val_{m}" for m in TABLE_METRICS]
    header += [f"share_{s}" for s in sites] + [f"train_loss_{s}" for s in sites]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for entry in rows:
            row = [entry["round"]] + ([entry.get("stage", "")] if staged else []) + [_fmt(entry.get("wall_seconds"))]
            row += [_fmt(entry["metrics"].get(m)) for m in tested]
            row += [_fmt(entry.get("site_mean", {}).get(m)) for m in site_mean]
            row += [_fmt(entry["val_metrics"].get(m)) for m in TABLE_METRICS]
            row += [_fmt(entry["share"].get(s)) for s in sites] + [_fmt(entry["train_loss"].get(s)) for s in sites]
            writer.writerow(row)


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def metric_columns(*metrics: Mapping[str, Any], headline: str = "") -> list[str]:
    """The metrics shown in tables: the standard four, plus head/medium/tail and per-attribute ones when present
    (in any of ``metrics``); ``headline`` (a report's headline metric) leads, so a multi-label run's macro AUROC is
    its first column, not its last."""
    present = {key for m in metrics for key, value in m.items() if value is not None}
    attributes = sorted(k for k in present if k.startswith("bacc_attr_") and k not in ATTRIBUTE_METRICS)
    ordered = (headline,) + TABLE_METRICS + LONG_TAIL_METRICS + tuple(attributes) + ATTRIBUTE_METRICS
    return [m for m in dict.fromkeys(ordered) if m in present]


def results_table(summaries: list[Mapping[str, Any]], with_seed: bool = False, headline: str = "") -> str:
    """A markdown table of final test metrics, one row per run (and its seed, when asked; ``headline`` first)."""
    if not summaries:
        return ""
    columns = metric_columns(*(s["final"] for s in summaries), headline=headline)
    first = ["method", "seed", "rounds"] if with_seed else ["method", "rounds"]
    lines = ["| " + " | ".join(first + columns) + " |", "|---" * (len(columns) + len(first)) + "|"]
    for s in summaries:
        values = " | ".join(_cell(s["final"].get(c)) for c in columns)
        seed = f" {s['config'].get('seed')} |" if with_seed else ""
        lines.append(f"| {s['method']} |{seed} {s['rounds_completed']} | {values} |")
    return "\n".join(lines)


def format_seconds(value: float | None, digits: int) -> str:
    """Seconds with `digits` decimals, or n/a when unknown (e.g. the start-up of a job launched elsewhere)."""
    return "n/a" if value is None else f"{value:.{digits}f} s"


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a"


# what lets text break a table cell, open a tag or a link, or start code or emphasis (an underscore inside a word,
# as in lesion_type_7, is literal in CommonMark and stays as written)
_MARKDOWN_SPECIAL = str.maketrans({c: f"\\{c}" for c in "\\`*[]<>|"} | {"\n": " ", "\r": " "})


def markdown_text(text: str) -> str:
    r"""``text`` from the data (a class name, say) as literal Markdown: no table cell broken, no HTML, no link, and
    no invisible character (a right-to-left override U+202E would show the text after it reversed): each shows as
    its escape, ``\u202e``."""
    literal = str(text).translate(_MARKDOWN_SPECIAL)
    return "".join(c if c.isprintable() else f"\\\\u{ord(c):04x}" for c in literal)


def class_names(summary: Mapping[str, Any]) -> list[str]:
    """The run's class names (from the data or ``task.class_names``), else ``class_<k>``."""
    task = summary["config"].get("task") or {}
    count = task.get("num_classes") or len(summary["final"].get("per_class_recall") or [])
    return list(task.get("class_names") or [f"class_{k}" for k in range(int(count or 0))])


# ----- report.md -----------------------------------------------------------------------------------------
def markdown_report(summary: Mapping[str, Any], plots: list[str] | None = None) -> str:
    """A human-readable report of :func:`build_summary`'s result: set-up, final metrics, best model, per site,
    per class, and ``plots`` (the run's image files, relative to the report)."""
    table = results_table([summary], headline=plotting.headline(summary))
    sections = [_header(summary), ["## Final test metrics", "", table, "", *best_model_lines(summary)],
                _per_site_section(summary), *_extra_sections(summary), _per_class_section(summary),
                _sites_section(summary), _plots_section(plots or [])]
    if summary.get("error"):
        sections.append([f"**The job failed:** {summary['error']}"])
    return "\n".join(line for section in sections if section for line in [*section, ""])


def _header(summary: Mapping[str, Any]) -> list[str]:
    cfg, timing, metric = summary["config"], summary["timing"], plotting.headline(summary)
    data = cfg.get("data", {})
    scored = "the global model" if server_holds_model(summary) else "each site's own model (the server holds none)"
    return [
        f"# medflare run: {summary['method']}",
        "",
        f"- data: `{data.get('source')}` partition `{data.get('partition', '-')}`, {cfg.get('clients')} sites, "
        f"{_models_text(cfg)}, {summary['rounds_completed']} rounds, seed {cfg.get('seed')}",
        f"- classes: {', '.join(markdown_text(name) for name in class_names(summary)) or 'n/a'}",
        *([f"- plan `{summary['plan']}` (the server's; every site logs the one it runs, `medflare config --plan` "
           f"prints the plan){_plan_check_text(summary)}"] if summary.get("plan") else []),
        *[resumed_text(start) for start in summary.get("resumed", [])],
        f"- mean round wall time {format_seconds(timing.get('mean_round_seconds'), 2)}; {startup_text(timing)}",
        f"- metrics are of {scored} on the sites' held-out test splits, summed as confusion counts "
        f"(exact pooled values); the headline metric is {metric_name(metric)} (`{metric}`), and the best model is chosen by "
        "its value on validation only; round r is the model after r rounds (round 0: the initial model)",
    ]


def resumed_text(start: Mapping[str, Any]) -> str:
    """A report line for one resume (``resume.start_record``): which job or folder, from which round, which model."""
    origin = f"job `{markdown_text(start['from_job'])}`" if "from_job" in start else \
        f"`{markdown_text(start.get('from', '?'))}`"
    digest = markdown_text(str(start.get("initial_model_digest", "?"))[:12])
    return f"- resumed from {origin} after {markdown_text(start.get('start_round', '?'))} round(s) (its model `{digest}`)"


def _plan_check_text(summary: Mapping[str, Any]) -> str:
    """What the job config this report describes is to the plan the server ran (``launch.plan_check``)."""
    check = summary.get("plan_check")
    if check == "matches":
        return "; the configuration in `summary.json` (`config`) resolves to the same plan"
    return f"; **warning:** the configuration in `summary.json` (`config`) {check}" if check and check != "unknown" \
        else ""


def server_holds_model(summary: Mapping[str, Any]) -> bool:
    """Whether the run's server held a global model (``summary["server_model"]``, :func:`build_summary`)."""
    return bool(summary.get("server_model", True))


def _models_text(cfg: Mapping[str, Any]) -> str:
    """``model `cnn` ``, or with per-site architectures each site's (the job's model for the sites not named)."""
    per_site = cfg.get("site_model") or {}
    if not per_site:
        return f"model `{cfg.get('model')}`"
    named = ", ".join(f"{site} `{model}`" for site, model in sorted(per_site.items()))
    every_site_named = len(per_site) >= int(cfg.get("clients") or 0)
    return f"models {named}" if every_site_named else f"models {named} (other sites `{cfg.get('model')}`)"


def best_model_lines(summary: Mapping[str, Any]) -> list[str]:
    """Which round's model ``best_FL_global_model.pt`` holds, and a warning when it is the untrained model 0."""
    best = summary.get("best") or {}
    if "model_version" not in best:
        return ["- no model was scored on validation, so no best model was chosen"]
    version = int(best["model_version"])
    metric, score = next(((k, v) for k, v in best.items() if k != "model_version"), ("validation score", None))
    if (summary.get("config") or {}).get("secure_aggregation") == "he":  # the server held only ciphertexts
        saved = ("not saved: with encrypted aggregation the server holds no plaintext model; "
                 "`FL_global_model.ckks.npz` is the final model, which only a site's TenSEAL context decrypts")
    elif server_holds_model(summary):
        saved = (f"saved as `best_FL_global_model.pt`; `FL_global_model.pt` is round {summary['rounds_completed']}")
    else:
        saved = ("the sites' models of that round; the server holds no model of this method, so "
                 "`FL_global_model.pt` and `best_FL_global_model.pt` carry no weights (each site keeps its own)")
    stage = next((e["stage"] for e in summary.get("per_round", []) if e["round"] == version and "stage" in e), None)
    where = f"round {version}" + (f", stage {stage}" if stage else "")
    lines = [f"- best model by validation {metric}: {where} ({metric} {_cell(score)}), {saved}"]
    warning = untrained_best_warning(summary)
    return lines + ([f"- **warning:** {warning}"] if warning else [])


def untrained_best_warning(summary: Mapping[str, Any]) -> str | None:
    """A warning when the best model by validation is the untrained initial model (round 0), else None."""
    best = summary.get("best") or {}
    if best.get("model_version") != 0:
        return None
    if not server_holds_model(summary):
        return ("the best validation score is that of the sites' untrained initial models (round 0): no round of "
                "training improved on it; train for more rounds or local epochs, or check the learning rate and the labels")
    return ("the best model by validation is the untrained initial model (round 0): no round of training improved "
            "on it, so best_FL_global_model.pt holds the initial weights; train for more rounds or local epochs, "
            "or check the learning rate and the labels")


def _per_site_table(title: str, note: str, block: Mapping[str, Any], summary: Mapping[str, Any]) -> list[str]:
    """Each site's row, the pooled value and the unweighted mean over sites."""
    if not block.get("by_site"):
        return []
    columns = metric_columns(*block["by_site"].values(), headline=plotting.headline(summary))
    clients = summary.get("clients", {})
    rows = [(site, clients.get(site, {}).get("n_test", "-"), m) for site, m in block["by_site"].items()]
    rows += [("**pooled**", "-", block.get("test", block)), ("**mean over sites**", "-", block["site_mean"])]
    return [title, "", note, "", "| site | test images | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 2) + "|",
            *(f"| {name} | {images} | " + " | ".join(_cell(m.get(c)) for c in columns) + " |" for name, images, m in rows)]


def _per_site_section(summary: Mapping[str, Any]) -> list[str]:
    scored = ("The final global model on each site's own test split" if server_holds_model(summary)
              else "Each site's own final model on its own test split")
    return _per_site_table(
        "## Per site", f"{scored}; the pooled row sums every site's counts, the mean is unweighted (the personalized-FL convention).", summary["final"], summary)


def _extra_sections(summary: Mapping[str, Any]) -> list[list[str]]:
    """One per-site table per method-declared evaluation (e.g. each site's own model)."""
    return [_per_site_table(f"## Evaluation '{name}' (declared by {summary['method']})",
                            "Scored at each site on its own test split, summed like the tables above.", block, summary)
            for name, block in sorted((summary["final"].get("extra") or {}).items())]


def _per_class_section(summary: Mapping[str, Any]) -> list[str]:
    final = summary["final"]
    recall, auc = final.get("per_class_recall"), final.get("per_class_auc") or []
    if not recall:
        return []
    counts = [facts["class_counts"] for facts in summary.get("clients", {}).values() if facts.get("class_counts")]
    train = [int(sum(column)) for column in zip(*counts)] if counts else None
    groups = _shot_group_names(summary, train)
    scored = "The final global model" if server_holds_model(summary) else "The sites' own final models"
    lines = ["## Per class", "", f"{scored} on the pooled test split; the confusion matrix is `confusion.png`.", "", "| class | name | training images | group | recall | AUC |", "|---|---|---|---|---|---|"]
    for k, name in enumerate(class_names(summary)):
        lines.append(f"| {k} | {markdown_text(name)} | {train[k] if train else '-'} | {groups.get(k, '-')} | "
                     f"{_cell(recall[k] if k < len(recall) else None)} | "
                     f"{_cell(auc[k] if k < len(auc) else None)} |")
    return lines


def _shot_group_names(summary: Mapping[str, Any], train: list[int] | None) -> dict[int, str]:
    """Head/medium/tail of each class: the plan's ``shot_groups`` (from ``shot_thresholds`` and the training counts,
    see ``--help``), or in a summary written before plans carried them, its thresholds over ``train``."""
    groups = summary["config"].get("shot_groups")
    thresholds = summary["config"].get("shot_thresholds")
    if not groups and thresholds and train:
        from medflare.metrics import shot_groups_from_counts

        groups = shot_groups_from_counts(train, head_min=thresholds[0], tail_max=thresholds[1])
    return {k: group for group, members in (groups or {}).items() for k in members}


def _sites_section(summary: Mapping[str, Any]) -> list[str]:
    private = any(facts.get(DP_EPSILON) for facts in summary["clients"].values())
    delta = (summary.get("config", {}).get("dp_sgd") or {}).get("delta")
    at_delta = f", δ = {delta:g}" if delta else ""
    epsilon_column = f" ε spent (DP-SGD{at_delta}) |" if private else ""
    lines = ["## Sites", "", f"| site | train samples | bytes sent per round |{epsilon_column}",
             "|---|---|---|" + ("---|" if private else "")]
    for site, facts in sorted(summary["clients"].items()):
        sent = summary["payload"].get(site, {}).get("bytes_per_round", [])
        row = f"| {site} | {facts.get('n_train', facts.get('n_samples_reported'))} | {sent[-1] if sent else '-'} |"
        spent = facts.get(DP_EPSILON) or []
        lines.append(row + (f" {spent[-1]:.3f} after {len(spent)} round(s) |" if spent else " - |" if private else ""))
    return lines


PLOT_CAPTIONS = {
    "learning_curves.png": "Learning curves: the model after each round, and each site's training loss",
    "shares.png": "Each site's share of the aggregate per round (stacked)",
    "per_site.png": "Each site's own test split",
    "confusion.png": "Confusion matrix of the final model (pooled test split)",
    "rf.png": "Fed-MAS rescue factor RF per site",
    "dp_epsilon.png": "DP-SGD: the ε each site has spent after each round",
    "diagnostics.png": "site-local diagnostics (never sent; copied out of the simulated site)",
}


def run_plots(out: Path) -> list[str]:
    """Every image of a run folder, relative to it: the run's own plots first, then each site's."""
    own = sorted(p.name for p in out.glob("*.png"))
    first = [name for name in PLOT_CAPTIONS if name in own]
    sites = sorted(p.relative_to(out).as_posix() for p in out.glob("sites/*/*.png"))
    return first + [name for name in own if name not in first] + sites


def _plots_section(plots: list[str]) -> list[str]:
    if not plots:
        return []
    lines = ["## Plots", ""]
    for plot in plots:
        name = Path(plot).name
        caption = PLOT_CAPTIONS.get(name, name.removesuffix(".png").replace("_", " "))
        if plot.startswith("sites/"):
            caption = f"{plot.split('/')[1]}: {caption}"
        lines += [f"### {caption}", "", f"![{caption}]({plot})", ""]
    return lines[:-1]


# ----- plots ---------------------------------------------------------------------------------------------
def write_plots(summary: Mapping[str, Any], out: Path) -> list[Path]:
    """Learning curves, shares, any other per-site value (e.g. RF), per-site headline scores and the confusion
    matrix; a plot without data is not drawn (:func:`plotting.save`), so the report never shows an empty one."""
    model = plotting.scored_model(summary)
    plots: list[tuple[str, Callable[[], Any]]] = [
        ("learning_curves.png", partial(plotting.learning_curves_figure, summary))]
    for key in site_valued_keys(summary["per_round"], summary.get("clients") or ()):
        if key == "share":
            plots.append(("shares.png", partial(plotting.shares_figure, summary)))
        elif key != "train_loss":
            plots.append((f"{key}.png", partial(plotting.per_site_value_figure, summary, key)))
    per_site = per_site_scores(summary)
    if per_site:
        metric = plotting.headline(summary)
        plots.append(("per_site.png", partial(plotting.per_site_metrics_figure, per_site, metric,
                                              summary["final"].get(metric), f"{model}, pooled")))
    if summary.get("final_confusion"):
        plots.append(("confusion.png", partial(plotting.confusion_figure, summary["final_confusion"],
                                               class_names(summary), model)))
    saved = (plotting.save(draw(), out / name) for name, draw in plots)
    return [path for path in saved if path is not None]


def per_site_scores(summary: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    """The final headline score on each site's own test split, per evaluated model (the scored model and each
    method-declared evaluation); empty when no site has one."""
    final, metric = summary["final"], plotting.headline(summary)
    blocks = {plotting.scored_model(summary): final, **dict(sorted((final.get("extra") or {}).items()))}
    rows = {name: {site: m.get(metric) for site, m in block.get("by_site", {}).items()}
            for name, block in blocks.items()}
    rows = {name: scores for name, scores in rows.items() if scores}
    return rows if any(v is not None for scores in rows.values() for v in scores.values()) else {}


def site_valued_keys(per_round: list[Mapping[str, Any]], sites: Iterable[str]) -> list[str]:
    """Per-round entries that map the run's sites to numbers (shares, RF, ...), in first-seen order (not
    ``server_seconds``, which maps span names to numbers: plotted per site it drew an empty figure)."""
    known, keys = set(sites), []
    for entry in per_round:
        for key, value in entry.items():
            numeric = isinstance(value, dict) and value and all(isinstance(v, (int, float)) for v in value.values())
            if numeric and set(value) <= known and key not in keys:
                keys.append(key)
    return keys


# ----- comparison of methods (and seeds): by the runs' headline metric -------------------------------------
def by_method(summaries: list[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Runs grouped by method, in the order the methods first appear (one run per seed)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for summary in summaries:
        groups.setdefault(summary["method"], []).append(summary)
    return groups


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def seed_statistics(runs: list[Mapping[str, Any]], columns: list[str]) -> dict[str, tuple[float, float] | None]:
    """Mean and std over seeds of each final metric (None where a run lacks it)."""
    values = {column: [run["final"].get(column) for run in runs] for column in columns}
    return {column: mean_std([float(v) for v in vs]) if all(isinstance(v, (int, float)) for v in vs) else None
            for column, vs in values.items()}


def verdicts(stats: Mapping[str, Mapping[str, tuple[float, float] | None]], metric: str,
             seeds: Mapping[str, int] | None = None) -> dict[str, str]:
    """Each method against the best mean of ``metric``: a gap within one standard deviation (the larger of the
    two methods') is **no difference** (the project's rule for seeded comparisons). Where either method ran one
    seed (``seeds``: runs per method; None: several), its spread is unknown, and the verdict gives the gap only."""
    known = {m: s[metric] for m, s in stats.items() if s.get(metric) is not None}
    if not known:
        return {}
    best = max(known, key=lambda m: known[m][0])
    out = {}
    for method, (mean, std) in known.items():
        gap, spread = known[best][0] - mean, max(std, known[best][1])
        one_seed = seeds is not None and min(seeds[method], seeds[best]) < 2
        out[method] = ("best" if method == best else
                       f"gap {gap:.4f}; spread unknown with one seed (compare with --seeds 0 1 2)" if one_seed else
                       f"no difference (gap {gap:.4f} ≤ 1 std {spread:.4f})" if gap <= spread else
                       f"worse by {gap:.4f} (> 1 std {spread:.4f})")
    return out


def comparison_table(summaries: list[Mapping[str, Any]]) -> str:
    """Mean ± std over seeds of each method's final test metrics, with the verdict against the best method."""
    groups = by_method(summaries)
    columns = metric_columns(*(s["final"] for s in summaries))
    stats = {method: seed_statistics(runs, columns) for method, runs in groups.items()}
    metric = plotting.headline(summaries[0])  # one task for every run compared
    verdict = verdicts(stats, metric, {method: len(runs) for method, runs in groups.items()})
    lines = [f"| method | seeds | rounds | {' | '.join(columns)} | vs best ({metric}) |", "|---" * (len(columns) + 4) + "|"]
    for method, runs in groups.items():
        cells = " | ".join("n/a" if stats[method][c] is None else f"{stats[method][c][0]:.4f} ± {stats[method][c][1]:.4f}"
                           for c in columns)
        lines.append(f"| {method} | {len(runs)} | {runs[0]['rounds_completed']} | {cells} | {verdict.get(method, '-')} |")
    return "\n".join(lines)


def per_round_curves(groups: Mapping[str, list[Mapping[str, Any]]], metric: str) -> dict[str, dict[str, Any]]:
    """Per method: ``metric`` per round (round 0 included when scored), mean and std over seeds, and the final
    value's mean and std."""
    curves = {}
    for method, runs in groups.items():
        scored = [plotting.scored_rounds(r) for r in runs]
        rounds = [e["round"] for e in scored[0]]
        per_round = [[entries[i]["metrics"].get(metric) for entries in scored if i < len(entries)]
                     for i in range(len(rounds))]
        spread = [mean_std([float(v) for v in values if v is not None]) if any(v is not None for v in values)
                  else (float("nan"), 0.0) for values in per_round]
        final = mean_std([float(r["final"].get(metric) or 0.0) for r in runs])
        curves[method] = {"rounds": rounds, "mean": [m for m, _ in spread], "std": [s for _, s in spread],
                          "final_mean": final[0], "final_std": final[1], "seeds": len(runs)}
    return curves


def comparison_outputs(summaries: list[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """comparison.md (mean ± std over seeds with the verdict, and every run) and comparison.png (error bars)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table_file = out / "comparison.md"
    seeds = max(len(runs) for runs in by_method(summaries).values())
    rule = ("A gap within one standard deviation over the seeds is **no difference**." if seeds > 1 else
            "One seed per method: the spread between seeds is unknown, so no gap here is shown to be a difference; "
            "compare with `--seeds 0 1 2`.")
    table_file.write_text("\n".join([
        "# Method comparison (test split of every site, pooled)", "",
        f"Mean ± standard deviation over {seeds} seed(s) of the final global model's metrics. {rule}", "",
        comparison_table(summaries), "", "## Every run", "", results_table(summaries, with_seed=True), ""]))
    metric = plotting.headline(summaries[0])
    figure = plotting.comparison_figure(per_round_curves(by_method(summaries), metric), metric)
    return [path for path in (table_file, plotting.save(figure, out / "comparison.png")) if path is not None]
