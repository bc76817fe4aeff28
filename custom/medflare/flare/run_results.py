"""The controller's record of a run, FLARE-free: ``medflare_results.json`` (a header, one record per round, each
model version's evaluation), the best model by validation, early stopping, and the state each round's checkpoint
keeps for a resumed job (:mod:`medflare.flare.resume_state`)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

import numpy as np

from medflare import contracts
from medflare.evaluation import DeclaredCounts, headline_metric, site_evaluation, without_histograms
from medflare.flare.memory import ALLOCATOR_ENV
from medflare.methods.base import RoundContext
from medflare.plan import RunPlan

RESULTS_FILE = "medflare_results.json"
# Per-site facts recorded each round; filter_history shows which privacy filters a site's result went through.
SITE_FACTS = (contracts.N_SAMPLES, contracts.TRAIN_LOSS, contracts.TRAIN_SECONDS, contracts.FILTER_HISTORY,
              contracts.DP_EPSILON)
RESULT_AT = "result_at"  # seconds from the round's start until the site's result reached the controller
TASK_BYTES = "task_bytes"  # a round's record: phase -> bytes of the task one site received (arrays + meta)


def results_header(plan: RunPlan, aggregator: Any) -> dict[str, Any]:
    """A job's results before its first round: the job, its plan's fingerprint, and the defences and encryption
    its server runs with, read from the server's own ``aggregator`` (a MedflareAggregator): an edited job records
    the truth, and an encrypted job's record says what its server does not write."""
    return {"method": plan.method, "num_rounds": len(plan.rounds), "key_metric": headline_metric(plan.task.multi_label),
            "plan": plan.digest(), "controller_started_at": time.time(),
            "robust_aggregation": aggregator.core.robust.record(),
            "allocator": {name: os.environ.get(name) for name in ALLOCATOR_ENV}, "rounds": [], "evaluations": {},
            **({} if aggregator.holds_plaintext else {"secure_aggregation": aggregator.encryption_record()})}


def new_record(round_index: int, started: float) -> dict[str, Any]:
    """A round's record as it starts (``round`` is the model version that the final validation scores)."""
    return {"round": round_index, "started_at": started, "failed": {}, "rejected": {}, "payload": {}, "sites": {},
            "server_seconds": {}}


def declined_text(rc: str, declined: Any) -> str:
    """A failed task's record: the return code, and a declining site's reason in medflare's words (a site sends a
    key of :data:`contracts.DECLINE_REASONS` only; anything else is not repeated)."""
    if declined is None:
        return str(rc)
    sentence = contracts.DECLINE_REASONS.get(declined) if isinstance(declined, str) else None
    return f"{rc}: declined: {sentence}" if sentence else f"{rc}: declined (an unrecognised reason, not recorded)"


def sites_text(reasons: Mapping[str, str]) -> str:
    """``{"site-2": "EXECUTION_EXCEPTION: declined: ..."}`` as ``site-2 EXECUTION_EXCEPTION: declined: ...`` (one
    site after another, by name; "none" when empty), as the console and the server's error line show it."""
    return "; ".join(f"{site} {why}" for site, why in sorted(reasons.items())) or "none"


def note_arrival(record: dict, site: str, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """A site's result reached the controller: when, and its array keys, meta keys and bytes (arrays + JSON meta)."""
    record["sites"].setdefault(site, {})[RESULT_AT] = time.time() - record["started_at"]
    entry = record["payload"].setdefault(site, {"arrays": 0, "meta_keys": [], "bytes": 0})
    entry["arrays"] += len(arrays)
    entry["meta_keys"] = sorted(set(entry["meta_keys"]) | set(meta))
    entry["bytes"] += payload_bytes(arrays, meta)


def payload_bytes(arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> int:
    """The bytes a task or result carries: its arrays' bytes plus its meta as JSON (no framing, no encryption)."""
    return int(sum(np.asarray(v).nbytes for v in arrays.values())) + len(json.dumps(meta, default=json_default))


def json_default(value: Any) -> Any:
    """``json.dumps`` fallback: numpy values as Python's, anything else as its text."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


class RunResults:
    """What a run has done: ``data`` (what ``medflare_results.json`` holds), the next round, the best validation
    score of ``key_metric`` (the task's headline metric) and the model that scored it until it is saved
    (``best_unsaved``). ``patience``: scored model versions in a row without a better one before the run stops."""

    def __init__(self, key_metric: str, patience: int = 0) -> None:
        self.key_metric, self.patience = key_metric, patience
        self.data: dict[str, Any] = {"rounds": [], "evaluations": {}}
        self.next_round = 0  # rounds before it are done (a resumed job skips them)
        self.best = -np.inf
        self.best_unsaved: dict[str, np.ndarray] | None = None
        self.declared_counts = DeclaredCounts()  # each site's evaluation split sizes, as it first reported them

    def accept_site_result(self, record: dict, evaluations: dict, site: str, meta: Mapping[str, Any],
                           num_classes: int, multi_label: bool) -> str:
        """An accepted result's facts into the round's record, and its (well-formed, or this raises) evaluation
        statistics into ``evaluations`` unless their counts contradict what the site declared first: that refusal
        is recorded and returned."""
        record["sites"].setdefault(site, {}).update({k: meta[k] for k in SITE_FACTS if k in meta})
        evaluation = site_evaluation(meta, num_classes, multi_label)
        refusal = self.declared_counts.refusal(site, evaluation) if evaluation else ""
        if refusal:
            record.setdefault("evaluation_refused", {})[site] = refusal
        elif evaluation:
            evaluations[site] = evaluation
        return refusal

    def fail_round(self, record: dict, phase: str) -> None:
        """The round of ``record`` ends the job (too few valid results): its failed and rejected sites are kept as
        ``failed_round``, where ``medflare watch`` and ``run`` read why the job failed."""
        self.data["failed_round"] = {"round": record["round"], "phase": phase, "failed": dict(record["failed"]),
                                     "rejected": dict(record["rejected"])}

    def finish_round(self, record: dict) -> None:
        self.data["rounds"].append(record)
        self.next_round = record["round"] + 1

    def record_evaluation(self, model_version: int, summary: Mapping[str, Any], params: dict | None) -> None:
        """Model ``model_version``'s pooled evaluation; a better validation score makes it the best model, whose
        ``params`` (None: the server cannot save them) wait in ``best_unsaved``."""
        self.data["evaluations"][str(model_version)] = without_histograms(summary)  # "final" keeps them
        score = summary.get("val", {}).get(self.key_metric)
        if score is not None and score > self.best:
            self.best = score
            self.data["best"] = {"model_version": model_version, self.key_metric: score}
            if params is not None:
                self.best_unsaved = params

    def stop_early(self, ctx: RoundContext) -> dict[str, Any] | None:
        """Why the run stops after ``ctx``'s round (also recorded) when ``patience`` scored model versions in a
        row brought no better validation score; else None."""
        best = self.data.get("best")
        if not self.patience or not ctx.scored or not best:
            return None
        stale = ctx.round - best["model_version"]  # this round scored model version ctx.round
        if stale < self.patience:
            return None
        self.data["stopped_early"] = {
            "after_round": ctx.round + 1, "patience": self.patience, "best_model_version": best["model_version"],
            self.key_metric: best[self.key_metric],
            "reason": f"val {self.key_metric} did not improve for {stale} rounds (best "
                      f"{best[self.key_metric]:.4f}, model {best['model_version']}; patience {self.patience})",
        }
        return self.data["stopped_early"]

    def state(self) -> dict[str, Any]:
        """What a round's checkpoint keeps beside the model: the next round, the results, the best score."""
        return {"next_round": self.next_round, "results": self.data, "best": self.best}

    def restore(self, state: Mapping[str, Any], method: str, num_rounds: int | None = None) -> None:
        """Continue from :meth:`state` of an earlier run of ``method`` (and of ``num_rounds``, unless None)."""
        job = {"method": method, **({} if num_rounds is None else {"num_rounds": num_rounds})}
        found = {k: state["results"].get(k) for k in job}
        if found != job:
            raise ValueError(f"the checkpoint is of another job ({found}); resume with the same method and rounds")
        self.next_round, self.data, self.best = int(state["next_round"]), dict(state["results"]), float(state["best"])

    def write(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=json_default)
        os.replace(tmp, path)  # never leave a half-written file
