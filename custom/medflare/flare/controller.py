"""The server-side FLARE controller: one round loop for every method.

Each round it sends the global model to the sites, accepts (validated) results as they arrive, aggregates
with the method's rule, persists the model, and records metrics, shares and payload sizes. Sites score the
model they receive before training, so round r's results carry the evaluation of model r at no extra round
trip; a final ``validate`` task scores the last model. Results go to ``medflare_results.json`` in the server's
app folder after every round, so a crashed job still leaves its history behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any

import numpy as np
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask, Task
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.impl.controller import Controller
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from medflare import contracts
from medflare.flare.aggregator import INFO, SHARES, MedflareAggregator
from medflare.flare.tasks import TASK_VALIDATE, round_meta
from medflare.methods.base import RoundContext
from medflare.metrics import EvalStats, compute_metrics
from medflare.ops.checkpoint import load_checkpoint, save_checkpoint

RESULTS_FILE = "medflare_results.json"
CHECKPOINT_FILE = "medflare_checkpoint.npz"  # get_persist_state() after every round, for a resumed job
BEST_MODEL_FILE = "best_FL_global_model.pt"  # written by FLARE's PT persistor
EVAL_KEYS = (("val", contracts.EVAL_VAL), ("test", contracts.EVAL_TEST))


class MedflareController(Controller):
    """Round loop shared by all methods.

    Args:
        num_rounds: federated rounds.
        min_clients: sites whose valid update a round needs; fewer stops the job with a clear error.
        persistor_id: component id of the model persistor (FLARE's PTFileModelPersistor).
        aggregator_id: component id of the MedflareAggregator.
        wait_time_after_min_received: once ``min_clients`` sites answered, how long the others may still take
            before the round goes on without them. A failed site counts as an answer, so this is what keeps a
            fast failure from cutting a round short.
        train_timeout: seconds a site may take for one task (0 = no limit).
        shot_groups: optional {"head": [...], "medium": [...], "tail": [...]} class ids for long-tail metrics.
        key_metric: validation metric that selects the best model (saved as best_FL_global_model.pt).
        resume_from: id of an earlier job of this server whose last checkpoint this job continues from (its
            rounds, results, best score and global model); FLARE 2.9 itself cannot resume a job after a crash.
    """

    def __init__(
        self,
        num_rounds: int = 5,
        min_clients: int = 2,
        persistor_id: str = "persistor",
        aggregator_id: str = "aggregator",
        wait_time_after_min_received: int = 600,
        train_timeout: int = 0,
        shot_groups: dict | None = None,
        key_metric: str = "balanced_accuracy",
        resume_from: str = "",
    ) -> None:
        super().__init__(task_check_period=0.05)
        self.num_rounds = num_rounds
        self.min_clients = min_clients
        self.persistor_id = persistor_id
        self.aggregator_id = aggregator_id
        self.wait_time_after_min_received = wait_time_after_min_received
        self.train_timeout = train_timeout
        self.shot_groups = shot_groups
        self.key_metric = key_metric
        self.resume_from = resume_from
        self._results: dict[str, Any] = {}
        self._best: float = -np.inf
        self._next_round = 0  # rounds before it are done (a resumed job skips them)

    # ----- FLARE lifecycle ------------------------------------------------------------------------
    def start_controller(self, fl_ctx: FLContext) -> None:
        self.persistor = self._engine.get_component(self.persistor_id)
        self.aggregator = self._engine.get_component(self.aggregator_id)
        if not isinstance(self.aggregator, MedflareAggregator):
            self.system_panic(f"component '{self.aggregator_id}' must be a MedflareAggregator", fl_ctx)
            return
        learnable = self.persistor.load(fl_ctx)
        self.global_params = {k: np.asarray(v) for k, v in learnable[ModelLearnableKey.WEIGHTS].items()}
        self.results_path = os.path.join(fl_ctx.get_prop(FLContextKey.APP_ROOT), RESULTS_FILE)
        self._results = {
            "method": self.aggregator.method,
            "num_rounds": self.num_rounds,
            "controller_started_at": time.time(),
            "rounds": [],
            "evaluations": {},
        }
        if self.resume_from:
            try:
                self._resume(fl_ctx)
            except (OSError, KeyError, ValueError) as exc:
                self.system_panic(f"medflare: cannot resume from job '{self.resume_from}': {exc}", fl_ctx)

    def stop_controller(self, fl_ctx: FLContext) -> None:
        self.cancel_all_tasks()

    def process_result_of_unknown_task(
        self, client: Client, task_name: str, client_task_id: str, result: Any, fl_ctx: FLContext
    ) -> None:
        self.log_warning(fl_ctx, f"ignoring a late '{task_name}' result from {client.name}")

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        try:
            round_index = 0
            for stage, stage_rounds in self.aggregator.core.rule.stages():
                for _ in range(stage_rounds):
                    if abort_signal.triggered:
                        return
                    if round_index >= self._next_round:  # a resumed job has the earlier rounds already
                        self._run_round(round_index, stage, abort_signal, fl_ctx)
                    round_index += 1
            self._final_validation(abort_signal, fl_ctx)
            self._results["finished_at"] = time.time()
            self._write_results()
            self.log_info(fl_ctx, f"medflare: finished {self.num_rounds} rounds; results in {self.results_path}")
        except Exception as exc:
            self._results["error"] = str(exc)
            self._write_results()
            self.log_exception(fl_ctx, f"medflare controller failed: {exc}")
            self.system_panic(f"medflare controller failed: {exc}", fl_ctx)

    # ----- one round --------------------------------------------------------------------------------
    def _run_round(self, round_index: int, stage: str, abort_signal: Signal, fl_ctx: FLContext) -> None:
        started = time.time()
        rule = self.aggregator.core.rule
        base = RoundContext(round=round_index, total_rounds=self.num_rounds, stage=stage)
        ctx = RoundContext(round_index, self.num_rounds, stage, server_meta=rule.server_meta(base))
        self.log_info(fl_ctx, f"medflare: round {round_index + 1}/{self.num_rounds} ({stage}) started")
        self.aggregator.start_round(self.global_params, ctx)
        fl_ctx.set_prop(AppConstants.CURRENT_ROUND, round_index, private=True, sticky=True)
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(self.global_params, {}), private=True, sticky=True)
        self.fire_event(AppEventType.ROUND_STARTED, fl_ctx)
        record = self._new_record(round_index, started)
        record["stage"] = stage
        evaluations: dict[str, dict] = {}
        for phase in rule.phases(ctx):
            arrays = self.aggregator.start_phase(phase)
            evaluations = self._broadcast(phase, arrays, ctx, record, abort_signal, fl_ctx) or evaluations
            if abort_signal.triggered:
                return
            self._require_enough_sites(round_index, phase, record)
        self._record_evaluation(round_index, evaluations, fl_ctx)
        self._aggregate(record, fl_ctx)
        record["wall_seconds"] = time.time() - started
        self._results["rounds"].append(record)
        self._write_results()
        self._save_checkpoint(round_index + 1, fl_ctx)
        self.fire_event(AppEventType.ROUND_DONE, fl_ctx)
        rejected = f", rejected {sorted(record['rejected'])}" if record["rejected"] else ""
        self.log_info(
            fl_ctx,
            f"medflare: round {round_index + 1}/{self.num_rounds} done in {record['wall_seconds']:.1f}s; "
            f"accepted {sorted(record['share'])}{rejected}",
        )

    def _require_enough_sites(self, round_index: int, phase: str, record: dict) -> None:
        record["rejected"].update(self.aggregator.core.rejected)
        accepted = len(self.aggregator.core.updates)
        if accepted < self.min_clients:
            raise RuntimeError(
                f"round {round_index + 1} ({phase}): only {accepted} site(s) sent a valid result, the job needs "
                f"min_clients={self.min_clients}. Failed: {record['failed']}; rejected: {record['rejected']}. "
                "Check those sites' logs, or lower min_clients."
            )

    def _new_record(self, round_index: int, started: float) -> dict[str, Any]:
        return {"round": round_index, "started_at": started, "failed": {}, "rejected": {}, "payload": {}, "sites": {}}

    def _broadcast(
        self, task_name: str, arrays: dict, ctx: RoundContext, record: dict, abort_signal: Signal, fl_ctx: FLContext
    ) -> dict[str, dict]:
        evaluations: dict[str, dict] = {}

        def on_result(client_task: ClientTask, fl_ctx: FLContext) -> None:
            self._on_result(task_name, client_task, record, evaluations, fl_ctx)
            client_task.result = None  # free memory: the aggregator keeps what it needs

        data = DXO(DataKind.WEIGHTS, data=arrays, meta=round_meta(ctx)).to_shareable()
        task = Task(name=task_name, data=data, timeout=self.train_timeout, result_received_cb=on_result)
        self.broadcast_and_wait(
            task=task,
            fl_ctx=fl_ctx,
            min_responses=self.min_clients,
            wait_time_after_min_received=self.wait_time_after_min_received,
            abort_signal=abort_signal,
        )
        return evaluations

    def _on_result(
        self, task_name: str, client_task: ClientTask, record: dict, evaluations: dict, fl_ctx: FLContext
    ) -> None:
        site, result = client_task.client.name, client_task.result
        rc = result.get_return_code()
        if rc != ReturnCode.OK:
            record["failed"][site] = str(rc)
            self.log_warning(fl_ctx, f"{site} returned {rc} for '{task_name}'; see that site's log")
            return
        try:
            dxo = from_shareable(result)
        except Exception as exc:
            record["rejected"][site] = f"not a valid DXO: {exc}"
            return
        meta = dxo.meta or {}
        add_payload(record["payload"], site, dxo)
        if task_name != TASK_VALIDATE:
            self.aggregator.accept(result, fl_ctx)
        facts = {k: meta[k] for k in (contracts.N_SAMPLES, contracts.TRAIN_LOSS, contracts.TRAIN_SECONDS) if k in meta}
        if facts:
            record["sites"][site] = facts
        evaluation = self._site_evaluation(site, meta, fl_ctx)
        if evaluation:
            evaluations[site] = evaluation

    def _site_evaluation(self, site: str, meta: dict, fl_ctx: FLContext) -> dict[str, EvalStats] | None:
        """The site's evaluation statistics, or None (logged) when absent or malformed."""
        if contracts.EVAL_TEST not in meta:
            return None
        num_classes = self.aggregator.num_classes
        try:
            evaluation: dict[str, Any] = {
                split: EvalStats.from_dict(meta[key], num_classes=num_classes) for split, key in EVAL_KEYS if key in meta
            }
            by_attribute = meta.get(contracts.EVAL_TEST_BY_ATTRIBUTE) or {}
            evaluation["test_by_attribute"] = {
                a: EvalStats.from_dict(d, num_classes=num_classes) for a, d in by_attribute.items()
            }
            return evaluation
        except Exception as exc:
            self.log_warning(fl_ctx, f"ignoring malformed evaluation statistics from {site}: {exc}")
            return None

    def _aggregate(self, record: dict, fl_ctx: FLContext) -> None:
        self.fire_event(AppEventType.BEFORE_AGGREGATION, fl_ctx)
        dxo = from_shareable(self.aggregator.aggregate(fl_ctx))
        self.global_params = dict(dxo.data)
        record["share"] = dxo.meta[SHARES]
        record.update(dxo.meta[INFO])
        learnable = make_model_learnable(self.global_params, {})
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)
        self.persistor.save(learnable, fl_ctx)

    # ----- evaluation -------------------------------------------------------------------------------
    def _record_evaluation(self, model_version: int, evaluations: dict[str, dict], fl_ctx: FLContext) -> None:
        """Sum the sites' statistics of model ``model_version`` and keep the best model by validation."""
        summary: dict[str, Any] = {"sites": sorted(evaluations)}
        for split in ("val", "test"):
            parts = [e[split] for e in evaluations.values() if split in e]
            if parts:
                stats = sum(parts[1:], parts[0])
                summary[split] = compute_metrics(stats, self.shot_groups)
                summary[f"{split}_stats"] = stats.to_dict()
        by_attribute: dict[str, list[EvalStats]] = {}
        for evaluation in evaluations.values():
            for attribute, stats in evaluation.get("test_by_attribute", {}).items():
                by_attribute.setdefault(attribute, []).append(stats)
        if by_attribute:
            summary["test_by_attribute"] = {
                a: compute_metrics(sum(parts[1:], parts[0])) for a, parts in sorted(by_attribute.items())
            }
        self._results["evaluations"][str(model_version)] = summary
        score = summary.get("val", {}).get(self.key_metric)
        if score is not None and score > self._best:
            self._best = score
            self._results["best"] = {"model_version": model_version, self.key_metric: score}
            self.fire_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, fl_ctx)
        bacc = summary.get("test", {}).get("balanced_accuracy")
        if bacc is not None:
            self.log_info(
                fl_ctx, f"medflare: model {model_version} test balanced accuracy {bacc:.4f} ({len(evaluations)} sites)"
            )

    def _final_validation(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        ctx = RoundContext(self.num_rounds, self.num_rounds, stage="final")
        record = self._new_record(self.num_rounds, time.time())
        evaluations = self._broadcast(TASK_VALIDATE, self.global_params, ctx, record, abort_signal, fl_ctx)
        self._record_evaluation(self.num_rounds, evaluations, fl_ctx)
        self._results["final_validation"] = {"wall_seconds": time.time() - record["started_at"], "failed": record["failed"]}

    # ----- state for a resumed job (FLARE's StatePersistable hooks) ----------------------------------
    def get_persist_state(self, fl_ctx: FLContext) -> dict:
        """What a resumed job needs: the next round to run, the results so far, the best score, the model."""
        return {"next_round": self._next_round, "results": self._results, "best": self._best,
                "global_params": self.global_params}

    def restore(self, state_data: dict, fl_ctx: FLContext) -> None:
        """Continue from :meth:`get_persist_state` of an earlier run of the same job (same model keys/shapes)."""
        params = {k: np.asarray(v) for k, v in state_data["global_params"].items()}
        differ = sorted(set(params) ^ set(self.global_params)) or sorted(
            k for k in params if params[k].shape != np.shape(self.global_params[k])
        )
        if differ:
            raise ValueError(f"the checkpoint's model differs from this job's model in {differ[:5]}")
        job = {k: state_data["results"].get(k) for k in ("method", "num_rounds")}
        if job != {"method": self.aggregator.method, "num_rounds": self.num_rounds}:
            raise ValueError(f"the checkpoint is of another job ({job}); resume with the same method and rounds")
        self.global_params = params
        self._next_round = int(state_data["next_round"])
        self._results = dict(state_data["results"])
        self._best = float(state_data["best"])

    def _save_checkpoint(self, next_round: int, fl_ctx: FLContext) -> None:
        self._next_round = next_round
        state = self.get_persist_state(fl_ctx)
        params = state.pop("global_params")
        save_checkpoint(os.path.join(os.path.dirname(self.results_path), CHECKPOINT_FILE), params, state, _json_default)

    def _resume(self, fl_ctx: FLContext) -> None:
        """Restore the last checkpoint of job ``resume_from`` (same submitter) from this server's own workspace."""
        job_id = str(uuid.UUID(self.resume_from))  # a job id, never a path
        app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
        run_dir = os.path.dirname(app_root)
        previous_run = os.path.join(os.path.dirname(run_dir), job_id)
        if _submitter(previous_run) != _submitter(run_dir):
            raise ValueError(f"job {job_id} was submitted by someone else; only its submitter may resume it")
        previous_app = os.path.join(previous_run, os.path.basename(app_root))
        params, state = load_checkpoint(os.path.join(previous_app, CHECKPOINT_FILE))
        self.restore({**state, "global_params": params}, fl_ctx)
        self._results["resumed"] = {"from_job": job_id, "at_round": self._next_round, "at": time.time()}
        self.persistor.save(make_model_learnable(self.global_params, {}), fl_ctx)
        if os.path.isfile(os.path.join(previous_app, BEST_MODEL_FILE)):
            shutil.copy(os.path.join(previous_app, BEST_MODEL_FILE), os.path.join(app_root, BEST_MODEL_FILE))
        self.log_info(fl_ctx, f"medflare: resumed job {job_id} at round {self._next_round + 1}/{self.num_rounds}")

    def _write_results(self) -> None:
        tmp = self.results_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self._results, f, indent=1, default=_json_default)
        os.replace(tmp, self.results_path)  # never leave a half-written file


def add_payload(payload: dict[str, dict], site: str, dxo: DXO) -> None:
    """Accumulate what one site sent this round: array keys, meta keys and bytes (arrays + JSON meta)."""
    arrays = dxo.data or {}
    array_bytes = int(sum(np.asarray(v).nbytes for v in arrays.values()))
    meta_bytes = len(json.dumps(dxo.meta or {}, default=_json_default))
    entry = payload.setdefault(site, {"arrays": 0, "meta_keys": [], "bytes": 0})
    entry["arrays"] += len(arrays)
    entry["meta_keys"] = sorted(set(entry["meta_keys"]) | set(dxo.meta or {}))
    entry["bytes"] += array_bytes + meta_bytes


def _submitter(run_dir: str) -> str:
    """Who submitted the job whose server run folder is ``run_dir`` (FLARE writes its meta.json there)."""
    with open(os.path.join(run_dir, "meta.json")) as f:
        return str(json.load(f)["submitter_name"])


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
