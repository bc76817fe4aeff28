"""The server-side FLARE controller: one round loop for every method.

Each round it sends the global model to the sites, accepts (validated) results as they arrive, aggregates
with the method's rule, persists the model, and records metrics, shares and payload sizes. Sites score the
model they receive before training, so round r's results carry the evaluation of model r at no extra round
trip; a final ``validate`` task scores the last model. Results go to ``medflare_results.json`` in the server's
app folder after every round, so a crashed job still leaves its history behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
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
from medflare.errors import PayloadError
from medflare.evaluation import site_evaluation, summarize
from medflare.flare.aggregator import INFO, SHARES, MedflareAggregator
from medflare.flare.tasks import TASK_VALIDATE, round_meta, round_plan
from medflare.methods.base import PerSite, RoundContext, Stage

RESULTS_FILE = "medflare_results.json"
# Per-site facts recorded each round; filter_history shows which privacy filters a site's result went through.
SITE_FACTS = (contracts.N_SAMPLES, contracts.TRAIN_LOSS, contracts.TRAIN_SECONDS, contracts.FILTER_HISTORY)


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
        self._results: dict[str, Any] = {}
        self._best: float = -np.inf

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

    def stop_controller(self, fl_ctx: FLContext) -> None:
        self.cancel_all_tasks()

    def process_result_of_unknown_task(
        self, client: Client, task_name: str, client_task_id: str, result: Any, fl_ctx: FLContext
    ) -> None:
        self.log_warning(fl_ctx, f"ignoring a late '{task_name}' result from {client.name}")

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        try:
            stages = self.aggregator.core.stages
            self._results["stages"] = [dataclasses.asdict(stage) for stage in stages]
            for ctx in round_plan(stages, self.num_rounds):
                if abort_signal.triggered:
                    return
                self._run_round(ctx, abort_signal, fl_ctx)
            self._final_validation(stages[-1], abort_signal, fl_ctx)
            self._results["finished_at"] = time.time()
            self._write_results()
            self.log_info(fl_ctx, f"medflare: finished {self.num_rounds} rounds; results in the server app's "
                          f"{os.path.basename(self.results_path)}")
        except Exception as exc:
            self._results["error"] = str(exc)
            self._write_results()
            self.log_exception(fl_ctx, f"medflare controller failed: {exc}")
            self.system_panic(f"medflare controller failed: {exc}", fl_ctx)

    # ----- one round --------------------------------------------------------------------------------
    def _run_round(self, plan: RoundContext, abort_signal: Signal, fl_ctx: FLContext) -> None:
        started = time.time()
        core = self.aggregator.core
        ctx = dataclasses.replace(plan, server_meta=core.rule.server_meta(plan))
        self.log_info(fl_ctx, f"medflare: round {ctx.round + 1}/{self.num_rounds} ({ctx.stage}) started")
        core.start_round(self.global_params, ctx)
        fl_ctx.set_prop(AppConstants.CURRENT_ROUND, ctx.round, private=True, sticky=True)
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(self.global_params, {}), private=True, sticky=True)
        self.fire_event(AppEventType.ROUND_STARTED, fl_ctx)
        record = self._new_record(ctx.round, started)
        record["stage"] = ctx.stage
        evaluations: dict[str, dict] = {}
        for phase in core.rule.phases(ctx):
            outgoing = core.start_phase(phase)
            self._send_phase(phase, outgoing, ctx, record, evaluations, abort_signal, fl_ctx)
            if abort_signal.triggered:
                return
            self._require_enough_sites(ctx.round, phase, record)
        if ctx.scored:
            self._record_evaluation(ctx.round, evaluations, fl_ctx)
        self._aggregate(record, fl_ctx)
        record["wall_seconds"] = time.time() - started
        self._results["rounds"].append(record)
        self._write_results()
        self.fire_event(AppEventType.ROUND_DONE, fl_ctx)
        rejected = f", rejected {sorted(record['rejected'])}" if record["rejected"] else ""
        self.log_info(
            fl_ctx,
            f"medflare: round {ctx.round + 1}/{self.num_rounds} done in {record['wall_seconds']:.1f}s; "
            f"accepted {sorted(record.get('share', {}))}{rejected}",
        )

    def _require_enough_sites(self, round_index: int, phase: str, record: dict) -> None:
        core = self.aggregator.core
        record["rejected"].update(core.rejected)
        accepted = len(core.updates)
        if accepted < self.min_clients:
            raise RuntimeError(
                f"round {round_index + 1} ({phase}): only {accepted} site(s) sent a valid result, the job needs "
                f"min_clients={self.min_clients}. Failed: {record['failed']}; rejected: {record['rejected']}. "
                "Check those sites' logs, or lower min_clients."
            )

    def _new_record(self, round_index: int, started: float) -> dict[str, Any]:
        return {"round": round_index, "started_at": started, "failed": {}, "rejected": {}, "payload": {}, "sites": {}}

    def _send_phase(
        self,
        phase: str,
        outgoing: dict | PerSite,
        ctx: RoundContext,
        record: dict,
        evaluations: dict[str, dict],
        abort_signal: Signal,
        fl_ctx: FLContext,
    ) -> None:
        """Send a phase's task (one broadcast, or one task per site) and collect results as they arrive."""
        header = {**round_meta(ctx), **self.aggregator.core.task_header()}

        def on_result(client_task: ClientTask, fl_ctx: FLContext) -> None:
            self._on_result(phase, client_task, record, evaluations, fl_ctx)
            client_task.result = None  # free memory: the aggregator keeps what it needs

        def make_task(arrays: dict) -> Task:
            data = DXO(DataKind.WEIGHTS, data=arrays, meta=header).to_shareable()
            return Task(name=phase, data=data, timeout=self.train_timeout, result_received_cb=on_result)

        if not isinstance(outgoing, PerSite):
            self.broadcast_and_wait(
                task=make_task(outgoing),
                fl_ctx=fl_ctx,
                min_responses=self.min_clients,
                wait_time_after_min_received=self.wait_time_after_min_received,
                abort_signal=abort_signal,
            )
            return
        tasks = {site: make_task(arrays) for site, arrays in sorted(outgoing.arrays.items())}
        for site, task in tasks.items():
            self.broadcast(task=task, fl_ctx=fl_ctx, targets=[site], min_responses=1)
        self._wait_for_sites(list(tasks.values()), abort_signal, fl_ctx)

    def _wait_for_sites(self, tasks: list[Task], abort_signal: Signal, fl_ctx: FLContext) -> None:
        """Wait for per-site tasks with broadcast's semantics: once ``min_clients`` answered, stragglers get
        ``wait_time_after_min_received`` seconds before their tasks are cancelled."""
        deadline = None
        while any(task.completion_status is None for task in tasks):
            if abort_signal.triggered:
                for task in tasks:
                    self.cancel_task(task, fl_ctx=fl_ctx)
                return
            answered = sum(task.completion_status is not None for task in tasks)
            if deadline is None and answered >= min(self.min_clients, len(tasks)):
                deadline = time.time() + self.wait_time_after_min_received
            if deadline is not None and time.time() > deadline:
                for task in tasks:
                    if task.completion_status is None:
                        self.cancel_task(task, fl_ctx=fl_ctx)
                return
            time.sleep(self._task_check_period)

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
        if task_name != TASK_VALIDATE and not self.aggregator.accept(result, fl_ctx):
            return  # a rejected result contributes nothing, its evaluation included
        facts = {k: meta[k] for k in SITE_FACTS if k in meta}
        if facts:
            record["sites"].setdefault(site, {}).update(facts)
        try:
            evaluation = site_evaluation(meta, self.aggregator.num_classes)
        except Exception as exc:
            self.log_warning(fl_ctx, f"ignoring malformed evaluation statistics from {site}: {exc}")
            return
        if evaluation:
            evaluations[site] = evaluation

    def _aggregate(self, record: dict, fl_ctx: FLContext) -> None:
        self.fire_event(AppEventType.BEFORE_AGGREGATION, fl_ctx)
        try:
            dxo = from_shareable(self.aggregator.aggregate(fl_ctx))
        except PayloadError as exc:  # nothing to aggregate, or a non-finite aggregate: keep the last model
            record["aggregation_error"] = str(exc)
            record["rejected"].update(self.aggregator.core.rejected)
            self.log_error(fl_ctx, f"medflare: round {record['round'] + 1}: {exc}")
            return
        record["rejected"].update(self.aggregator.core.rejected)  # includes robust-rule rejections
        self.global_params = dict(dxo.data)
        record["share"] = dxo.meta[SHARES]
        record.update(dxo.meta[INFO])
        learnable = make_model_learnable(self.global_params, {})
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)
        self.persistor.save(learnable, fl_ctx)

    # ----- evaluation -------------------------------------------------------------------------------
    def _record_evaluation(self, model_version: int, evaluations: dict[str, dict], fl_ctx: FLContext) -> dict:
        """Sum the sites' statistics of model ``model_version`` and keep the best model by validation."""
        summary = summarize(evaluations, self.shot_groups)
        self._results["evaluations"][str(model_version)] = summary
        score = summary.get("val", {}).get(self.key_metric)
        if score is not None and score > self._best:
            self._best = score
            self._results["best"] = {"model_version": model_version, self.key_metric: score}
            self.fire_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, fl_ctx)
        bacc = summary.get("test", {}).get("balanced_accuracy")
        if bacc is not None:
            # the counter of rounds.csv and report.md: round r = the global model after r rounds of training
            which = f"global model after round {model_version}" if model_version else "initial global model (round 0)"
            self.log_info(fl_ctx, f"medflare: {which}: test balanced accuracy {bacc:.4f} ({len(evaluations)} sites)")
        return summary

    def _final_validation(self, last_stage: Stage, abort_signal: Signal, fl_ctx: FLContext) -> None:
        """Score the final global model at every site; its metrics land in ``results["final"]``."""
        ctx = RoundContext(
            self.num_rounds, self.num_rounds, stage=last_stage.name, stage_round=last_stage.rounds,
            stage_rounds=last_stage.rounds, scored=True,
        )
        record = self._new_record(self.num_rounds, time.time())
        core = self.aggregator.core
        core.start_round(self.global_params, ctx)
        keys = core.spec.payload.shared_keys(list(self.global_params), ctx.stage)
        arrays = {k: self.global_params[k] for k in keys}
        evaluations: dict[str, dict] = {}
        self._send_phase(TASK_VALIDATE, arrays, ctx, record, evaluations, abort_signal, fl_ctx)
        final = self._record_evaluation(self.num_rounds, evaluations, fl_ctx)
        method_metrics = core.rule.final_metrics(final)
        self._results["final"] = {"model_version": self.num_rounds, **final, "method_metrics": method_metrics}
        self._results["final_validation"] = {"wall_seconds": time.time() - record["started_at"], "failed": record["failed"]}

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


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
