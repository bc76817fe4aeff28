"""Per-round progress: one wording for the server's log (which the simulator shows live) and ``medflare watch``,
which reads the controller's entries through FLARE's ``show_stats`` (any admin with the ``view`` right)."""

from __future__ import annotations

from typing import Any, Mapping

from medflare.evaluation import metric_name, selection_metric
from medflare.flare.run_results import sites_text

STATS_GROUP = "medflare"  # the group name in FLARE's show_stats reply


def round_entry(record: Mapping[str, Any], num_rounds: int) -> dict[str, Any]:
    """A finished round: its 1-based number, wall time, and the sites accepted and rejected."""
    return {"kind": "round", "round": record["round"] + 1, "rounds": num_rounds, "stage": record.get("stage"),
            "seconds": record.get("wall_seconds"), "accepted": sorted(record.get("share", {})),
            "rejected": sorted(record.get("rejected", {}))}


def evaluation_entry(model_version: int, summary: Mapping[str, Any], key_metric: str) -> dict[str, Any] | None:
    """The pooled test and validation scores of one model version in ``key_metric`` (the task's headline metric,
    which selects the best model), or None when the sites sent no test statistics."""
    if not summary.get("test"):
        return None
    return {"kind": "evaluation", "model": model_version, "sites": len(summary.get("sites", [])), "metric": key_metric,
            "test": {key_metric: summary["test"].get(key_metric)},
            "val": {key_metric: summary.get("val", {}).get(key_metric)}}


def stop_entry(stopped: Mapping[str, Any]) -> dict[str, Any]:
    """The controller's decision to stop early (see ``MedflareController``)."""
    return {"kind": "stopped", **stopped}


def entries_from_results(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The progress entries of a results file, in the order the controller reports them: each round's
    evaluation of the model it received, the round itself, an early stop, the final model's evaluation."""
    entries: list[dict[str, Any] | None] = []
    evaluations = results.get("evaluations", {})
    key = selection_metric(results)
    rounds = results.get("rounds", [])
    for record in rounds:
        entries.append(evaluation_entry(record["round"], evaluations.get(str(record["round"]), {}), key))
        entries.append(round_entry(record, results.get("num_rounds", len(rounds))))
    if results.get("stopped_early"):
        entries.append(stop_entry(results["stopped_early"]))
    final = results.get("final")
    if final:
        entries.append(evaluation_entry(final["model_version"], final, key))
    return [entry for entry in entries if entry is not None]


def failure_cause(results: Mapping[str, Any]) -> str:
    """Why a job failed, in one line, from its results file: the round that ended it (which sites failed or
    declined, in medflare's words; else the first earlier round where one did) and the controller's error; ""
    when the file records neither."""
    ended = results.get("failed_round")
    failing = ended if ended and (ended.get("failed") or ended.get("rejected")) else next(
        (record for record in results.get("rounds", []) if record.get("failed")), None)
    parts = []
    if failing is not None:
        said = [sites_text(failing["failed"])] if failing.get("failed") else []
        said += [f"rejected {sites_text(failing['rejected'])}"] if failing.get("rejected") else []
        parts.append(f"round {failing.get('round', 0) + 1}: {'; '.join(said)}")
    if results.get("error"):
        parts.append(f"the server: {results['error']}")
    return " | ".join(parts)


def format_progress(entry: Mapping[str, Any]) -> str:
    """The line an entry is shown as, in the server log and by ``medflare watch``."""
    kind = entry.get("kind")
    if kind == "round":
        rejected = f", rejected {entry['rejected']}" if entry.get("rejected") else ""
        return (f"round {entry['round']}/{entry['rounds']} done in {entry['seconds']:.1f}s; "
                f"accepted {entry['accepted']}{rejected}")
    if kind == "evaluation":
        return f"model {entry['model']} {_scores_text(entry)} ({entry['sites']} sites)"
    if kind == "stopped":
        return f"stopping early after round {entry['after_round']}: {entry['reason']}"
    return str(dict(entry))


def _scores_text(entry: Mapping[str, Any]) -> str:
    """``test macro AUROC 0.7123, val 0.7010``. ``medflare watch`` may follow a server of an earlier medflare,
    whose entries name no ``metric`` and give balanced accuracy as ``test_balanced_accuracy``."""
    metric = entry.get("metric", "balanced_accuracy")
    test = entry.get("test", {}).get(metric, entry.get("test_balanced_accuracy"))
    val = entry.get("val", {}).get(metric)
    return f"test {metric_name(metric)} {_score(test)}" + ("" if val is None else f", val {_score(val)}")


def _score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
