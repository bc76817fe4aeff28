"""The server-side FLARE controller: one round loop for every method.

Each round it sends the global model to the sites, accepts (validated) results as they arrive, aggregates
with the method's rule, checkpoints the round, and records metrics, shares, payload sizes and where the server's
time went (``server_seconds``); the model file itself is written once, after the last round. Sites score the
model they receive before training, so round r's results carry the evaluation of model r at no extra round
trip; a final ``validate`` task scores the last model. Results go to ``medflare_results.json`` in the server's
app folder after every round, so a crashed job still leaves its history behind.

Optional: early stopping on the validation key metric (``patience``), resuming a previous job's history and
model (``resume_from``, :mod:`medflare.resume`), per-round metrics as FLARE analytics events (experiment
tracking, :mod:`medflare.flare.tracking`) and progress entries in FLARE's ``show_stats`` (``medflare watch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask, Task, TaskCompletionStatus
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.impl.controller import Controller
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.widgets.info_collector import GroupInfoCollector, InfoCollector

from medflare import contracts, resume
from medflare.errors import MedflareError, PayloadError
from medflare.evaluation import DeclaredCounts, headline_metric, site_evaluation, summarize, without_histograms
from medflare.flare.aggregator import INFO, SHARES, MedflareAggregator
from medflare.flare.memory import ALLOCATOR_ENV, collect_round_garbage, freeze_startup_objects
from medflare.flare.progress import (
    STATS_GROUP,
    entries_from_results,
    evaluation_entry,
    format_progress,
    round_entry,
    stop_entry,
)
from medflare.flare.tasks import TASK_VALIDATE, deployed_plan, round_meta
from medflare.flare.tracking import record_scalars, round_scalars, send_scalars
from medflare.methods.base import PerSite, RoundContext
from medflare.ops.background import BackgroundWrite
from medflare.ops.checkpoint import load_checkpoint, save_checkpoint
from medflare.ops.timing import timed
from medflare.plan import PLAN_FILE, RunPlan
from medflare.server_setup import round_plan

RESULTS_FILE = "medflare_results.json"
# Per-site facts recorded each round; filter_history shows which privacy filters a site's result went through.
SITE_FACTS = (contracts.N_SAMPLES, contracts.TRAIN_LOSS, contracts.TRAIN_SECONDS, contracts.FILTER_HISTORY,
              contracts.DP_EPSILON)
RESULT_AT = "result_at"  # seconds from the round's start until the site's result reached the controller
TASK_BYTES = "task_bytes"  # a round's record: phase -> bytes of the task one site received (arrays + meta)
CHECKPOINT_FILE = "medflare_checkpoint.npz"  # get_persist_state() after every round, for a resumed job
BEST_MODEL_FILE = "best_FL_global_model.pt"  # written by FLARE's PT persistor
# The longest a site's request for its next task is held while the server works between two phases; past it the
# site hears "try again" as before. Longer than the server's usual turn (0.1-0.3 s, docs/benchmarks.md), short
# enough that FLARE's heartbeats, which wait for the same lock, stay far inside their timeouts.
TASK_HOLD_SECONDS = 1.0


class PhaseAnswers:
    """The sites whose result of the current phase has been processed, and an event set at each one."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self._sites: set[str] = set()
        self._lock = threading.Lock()

    def add(self, site: str) -> None:
        with self._lock:
            self._sites.add(site)
        self.wake.set()

    def sites(self) -> set[str]:
        with self._lock:
            return set(self._sites)


class NextTaskHold:
    """Holds a site's request for its next task while the server works between two phases.

    Once every answer of a phase is in, the sites that answered ask for their next task while the server still
    aggregates and scores; told "try again", a site waits a whole poll period before it asks again: a fixed 0.5 s
    in FLARE's simulator (``simulator_worker``), ``task_request_interval`` in POC and production. Instead, such a
    request (FLARE's ``BEFORE_PROCESS_TASK_REQUEST`` event) waits here until the next task is out, at most
    ``limit`` seconds, and is then answered at once. Only the sites that answered the phase are held: the next
    phase is theirs. The wait runs under FLARE's workflow lock, which result submissions also take, so it only
    happens when no result of the phase is outstanding.
    """

    def __init__(self, limit: float = TASK_HOLD_SECONDS) -> None:
        self.limit = limit
        self._task_out = threading.Event()
        self._task_out.set()
        self._sites: frozenset[str] = frozenset()

    def between_phases(self, answered: set[str]) -> None:
        """Every answer of a phase is in: ``answered`` will ask for the next task before it is out."""
        self._sites = frozenset(answered)
        self._task_out.clear()

    def task_out(self) -> None:
        """The next task is out, or none will come: release every held request."""
        self._task_out.set()

    def hold(self, site: str | None) -> float:
        """Wait (at most ``limit`` s) while ``site``'s next task is not out yet; the seconds waited."""
        if site not in self._sites or self._task_out.is_set():
            return 0.0
        started = time.monotonic()
        self._task_out.wait(self.limit)
        return time.monotonic() - started


def declined_text(rc: str, declined: Any) -> str:
    """A failed task's record: the return code, and a declining site's reason in medflare's words (a site sends a
    key of :data:`contracts.DECLINE_REASONS` only; anything else is not repeated)."""
    if declined is None:
        return str(rc)
    sentence = contracts.DECLINE_REASONS.get(declined) if isinstance(declined, str) else None
    return f"{rc}: declined: {sentence}" if sentence else f"{rc}: declined (an unrecognised reason, not recorded)"


class MedflareController(Controller):
    """Round loop shared by all methods.

    Args:
        plan_file: the job's plan in its ``app/config`` folder (``medflare_plan.json``, :mod:`medflare.plan`), read
            when the job starts. The controller runs its rounds, the valid results each needs (``min_clients``),
            how long stragglers may take once those answered (``straggler_seconds``: a failed site counts as an
            answer, so a fast failure does not cut a round short), each task's time limit (``task_timeout``), the
            long-tail metrics' classes (``shot_groups``), early stopping (``patience``: scored rounds without a
            better headline metric, :func:`medflare.evaluation.headline_metric`, than the best model's, which is
            saved as best_FL_global_model.pt) and ``resume_from``: in POC and production the *id* of an earlier
            job of this server (same submitter) whose last checkpoint this job continues from, e.g. after a server
            crash (FLARE 2.9 itself cannot resume a job); in FLARE's simulator only, a folder holding a previous
            run's ``medflare_results.json`` and ``FL_global_model.pt`` (``medflare run --resume``). A job never
            makes a deployed server read a path it names.
        persistor_id: component id of the model persistor (:class:`medflare.flare.persistor.MedflareModelPersistor`).
        aggregator_id: component id of the MedflareAggregator.
    """

    def __init__(self, plan_file: str = PLAN_FILE, persistor_id: str = "persistor",
                 aggregator_id: str = "aggregator") -> None:
        super().__init__(task_check_period=0.05)
        self.plan_file = plan_file
        self.persistor_id = persistor_id
        self.aggregator_id = aggregator_id
        self.plan: RunPlan | None = None  # the job's, loaded at START_RUN (before start_controller)
        self._declared_counts = DeclaredCounts()  # each site's evaluation split sizes, as it first reported them
        self._results: dict[str, Any] = {}
        self._best: float = -np.inf
        self._next_round = 0  # rounds before it are done (a resumed job skips them)
        self._progress: list[dict[str, Any]] = []  # what show_stats serves to `medflare watch`
        self._checkpoint_write = BackgroundWrite("medflare-checkpoint")  # written while the sites train
        self._housekeeping: Callable[[], None] | None = None  # the last round's _close_round, until it ran
        self._best_unsaved: dict[str, np.ndarray] | None = None  # scored best, saved by the next housekeeping
        self._next_task = NextTaskHold()
        self._plan_digest = ""  # the fingerprint of the job's plan

    def use_plan(self, plan: RunPlan) -> MedflareController:
        """Run ``plan`` (at START_RUN from the job's plan file; a test may hand one in)."""
        self.plan = plan
        self.num_rounds, self.min_clients = len(plan.rounds), plan.min_clients
        self.wait_time_after_min_received, self.train_timeout = plan.straggler_seconds, plan.task_timeout
        self.shot_groups, self.patience, self.resume_from = plan.shot_groups, plan.patience, plan.resume_from
        self.key_metric = headline_metric(plan.task.multi_label)
        self._plan_digest = plan.digest()
        return self

    # ----- FLARE lifecycle ------------------------------------------------------------------------
    def start_controller(self, fl_ctx: FLContext) -> None:
        if self.plan is None:  # START_RUN could not load it, and said why
            self.system_panic("medflare: the controller has no plan to run", fl_ctx)
            return
        self.persistor = self._engine.get_component(self.persistor_id)
        self.aggregator = self._engine.get_component(self.aggregator_id)
        if not isinstance(self.aggregator, MedflareAggregator):
            self.system_panic(f"component '{self.aggregator_id}' must be a MedflareAggregator", fl_ctx)
            return
        learnable = self.persistor.load(fl_ctx)
        self.global_params = {k: np.asarray(v) for k, v in learnable[ModelLearnableKey.WEIGHTS].items()}
        self.results_path = os.path.join(fl_ctx.get_prop(FLContextKey.APP_ROOT), RESULTS_FILE)
        self._results = self._fresh_header()
        freeze_startup_objects()
        if self.resume_from:
            try:
                self._resume(fl_ctx)
            except (OSError, KeyError, ValueError, MedflareError) as exc:
                self.system_panic(f"medflare: cannot resume from '{self.resume_from}': {exc}", fl_ctx)

    def _fresh_header(self) -> dict[str, Any]:
        return {"method": self.plan.method, "num_rounds": self.num_rounds, "key_metric": self.key_metric,
                **({"plan": self._plan_digest} if self._plan_digest else {}),
                "controller_started_at": time.time(),
                # the defences this server runs with, read from its own aggregator: an edited job records the truth
                "robust_aggregation": self.aggregator.core.robust.record(),
                "allocator": {name: os.environ.get(name) for name in ALLOCATOR_ENV}, "rounds": [], "evaluations": {},
                **({} if self.aggregator.holds_plaintext else  # what an encrypted job's server does not write
                   {"secure_aggregation": self.aggregator.encryption_record()})}

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN and self.plan is None:
            self._load_plan(fl_ctx)
        elif event_type == InfoCollector.EVENT_TYPE_GET_STATS:  # FLARE's show_stats: progress for medflare watch
            collector = fl_ctx.get_prop(InfoCollector.CTX_KEY_STATS_COLLECTOR, None)
            if isinstance(collector, GroupInfoCollector):
                collector.add_info(STATS_GROUP, {"num_rounds": self.num_rounds, "progress": list(self._progress)})
        elif event_type == EventType.BEFORE_PROCESS_TASK_REQUEST:
            peer = fl_ctx.get_peer_context()
            self._next_task.hold(peer.get_identity_name() if peer is not None else None)
        super().handle_event(event_type, fl_ctx)

    def _load_plan(self, fl_ctx: FLContext) -> None:
        """The job's plan as FLARE deployed it; its fingerprint goes into the results and the log, beside each
        site's."""
        try:
            plan, loaded = deployed_plan(fl_ctx, self.plan_file)
        except MedflareError as exc:
            self.system_panic(f"medflare: cannot load this job's plan: {exc}", fl_ctx)
            return
        self.use_plan(plan)
        self.log_info(fl_ctx, f"medflare: {loaded}")

    def stop_controller(self, fl_ctx: FLContext) -> None:
        self._next_task.task_out()
        self.cancel_all_tasks()
        with contextlib.suppress(Exception):  # an aborted job still leaves its last round's checkpoint whole
            self._checkpoint_write.wait()

    def process_result_of_unknown_task(
        self, client: Client, task_name: str, client_task_id: str, result: Any, fl_ctx: FLContext
    ) -> None:
        self.log_warning(fl_ctx, f"ignoring a late '{task_name}' result from {client.name}")

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        try:
            stages = self.aggregator.core.stages
            self._results["stages"] = [dataclasses.asdict(stage) for stage in stages]
            last = None
            for ctx in round_plan(stages, self.num_rounds)[self._next_round:]:  # a resumed job skips done rounds
                if abort_signal.triggered:
                    break
                self._run_round(ctx, abort_signal, fl_ctx)
                last = ctx
                if self._stopping_early(ctx, fl_ctx):
                    break
            self._run_housekeeping()
            self._persist_global_model(fl_ctx)
            if abort_signal.triggered:
                return
            self._final_validation(last or round_plan(stages, self.num_rounds)[-1], abort_signal, fl_ctx)
            self._checkpoint_write.wait()  # the last round's checkpoint is complete before the job ends
            self._results["finished_at"] = time.time()
            self._write_results()
            # no path: in the simulator this workspace is a staging folder that is gone once the run's outputs
            # are in place (the launcher prints where they are)
            self.log_info(fl_ctx, f"medflare: finished {len(self._results['rounds'])} rounds; {RESULTS_FILE} "
                                  "written in the job's app_server folder")
        except Exception as exc:
            self._results["error"] = str(exc)
            self._write_results()
            with contextlib.suppress(Exception):  # the last good model and checkpoint are kept beside the error
                self._run_housekeeping()
                self._persist_global_model(fl_ctx)
                self._checkpoint_write.wait()
            self.log_exception(fl_ctx, f"medflare controller failed: {exc}")
            self.system_panic(f"medflare controller failed: {exc}", fl_ctx)
        finally:
            self._next_task.task_out()  # no more tasks: a held request hears "try again" or END_RUN now

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
        spans = record["server_seconds"]
        if ctx.scored:
            with timed(spans, "evaluation"):  # a better model is saved later, once the next task is out
                self._record_evaluation(ctx.round, evaluations, fl_ctx)
        with timed(spans, "aggregate"):
            self._aggregate(record, fl_ctx)
        record["wall_seconds"] = time.time() - started
        self._results["rounds"].append(record)
        self._next_round = ctx.round + 1
        with timed(spans, "results_file"):  # before the next round: a crash or SIGTERM still finds this round
            self._write_results()
        self.fire_event(AppEventType.ROUND_DONE, fl_ctx)
        self._housekeeping = lambda: self._close_round(record, fl_ctx)  # runs once the next task is out
        send_scalars(self, fl_ctx, record_scalars(record), step=ctx.round + 1)
        self._report(round_entry(record, self.num_rounds), fl_ctx)

    def _close_round(self, record: dict, fl_ctx: FLContext) -> None:
        """The round's checkpoint and garbage collection: off the critical path, because the sites already train
        on the next round's task while it runs (they poll for that task, and a server still busy with
        bookkeeping when a site asks costs it a whole poll interval)."""
        spans = record["server_seconds"]
        with timed(spans, "best_model"):  # before the checkpoint, which names the best model version
            self._save_best_model(fl_ctx)
        with timed(spans, "checkpoint"):  # recorded in the next write (the last round's: in the final one)
            if self.aggregator.holds_plaintext:  # an encrypted job's server holds ciphertexts: no resume point
                self._save_checkpoint(fl_ctx)
        with timed(spans, "gc"):  # FLARE's transfers of this round sit in reference cycles (flare/memory.py)
            record["gc_objects_freed"] = collect_round_garbage()

    def _run_housekeeping(self) -> None:
        """The last round's deferred :meth:`_close_round`, if it has not run yet."""
        pending, self._housekeeping = self._housekeeping, None
        if pending is not None:
            pending()

    def _report(self, entry: dict[str, Any] | None, fl_ctx: FLContext) -> None:
        """Log a progress entry and keep it for show_stats."""
        if entry is not None:
            self._progress.append(entry)
            self.log_info(fl_ctx, f"medflare: {format_progress(entry)}")

    def _stopping_early(self, ctx: RoundContext, fl_ctx: FLContext) -> bool:
        """True when ``patience`` scored model versions in a row brought no better validation score."""
        best = self._results.get("best")
        if not self.patience or not ctx.scored or not best:
            return False
        stale = ctx.round - best["model_version"]  # this round scored model version ctx.round
        if stale < self.patience:
            return False
        stopped = {
            "after_round": ctx.round + 1, "patience": self.patience, "best_model_version": best["model_version"],
            self.key_metric: best[self.key_metric],
            "reason": f"val {self.key_metric} did not improve for {stale} rounds (best "
                      f"{best[self.key_metric]:.4f}, model {best['model_version']}; patience {self.patience})",
        }
        self._results["stopped_early"] = stopped
        self._report(stop_entry(stopped), fl_ctx)
        return True

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
        return {"round": round_index, "started_at": started, "failed": {}, "rejected": {}, "payload": {}, "sites": {},
                "server_seconds": {}}

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
        answers = PhaseAnswers()

        def on_result(client_task: ClientTask, fl_ctx: FLContext) -> None:
            try:
                self._on_result(phase, client_task, record, evaluations, fl_ctx)
            finally:
                client_task.result = None  # free memory: the aggregator keeps what it needs
                answers.add(client_task.client.name)

        def make_task(arrays: dict) -> Task:
            data = DXO(DataKind.WEIGHTS, data=arrays, meta=header).to_shareable()
            return Task(name=phase, data=data, timeout=self.train_timeout, result_received_cb=on_result)

        sent = outgoing.arrays.values() if isinstance(outgoing, PerSite) else [outgoing]
        # what one site receives in this phase (the largest task when each gets its own): the download's bytes
        record.setdefault(TASK_BYTES, {})[phase] = max((payload_bytes(a, header) for a in sent), default=0)
        if isinstance(outgoing, PerSite):
            tasks = []
            for site, arrays in sorted(outgoing.arrays.items()):
                tasks.append(make_task(arrays))
                self.broadcast(task=tasks[-1], fl_ctx=fl_ctx, targets=[site], min_responses=1)
        else:  # every registered site; FLARE fixes the list (task.targets) when it schedules the task
            tasks = [make_task(outgoing)]
            self.broadcast(task=tasks[0], fl_ctx=fl_ctx, min_responses=self.min_clients,
                           wait_time_after_min_received=self.wait_time_after_min_received)
        self._next_task.task_out()
        self._run_housekeeping()  # the previous round's, while the sites fetch and train
        self._wait_for_answers(tasks, answers, abort_signal, fl_ctx)

    def _wait_for_answers(
        self, tasks: list[Task], answers: PhaseAnswers, abort_signal: Signal, fl_ctx: FLContext
    ) -> None:
        """Wait with ``broadcast_and_wait``'s rules, but go on the moment the last site's result is processed.

        Every target answered: done. Once ``min_clients`` answered, stragglers get
        ``wait_time_after_min_received`` seconds before their tasks are cancelled; a task FLARE ends itself
        (timeout, dead site) counts as answered. FLARE's own wait only sees a finished task through two polling
        loops in a row (its task monitor, then ``broadcast_and_wait``), which cost about 0.2 s per phase
        (measured: docs/benchmarks.md); :class:`PhaseAnswers` wakes this loop from the result callback instead.
        """
        targets = {name for task in tasks for name in task.targets or ()}
        deadline = None
        while True:
            answers.wake.clear()  # before the checks: a result that lands after them still wakes the wait
            answered = answers.sites()
            if abort_signal.triggered or targets <= answered or all(t.completion_status is not None for t in tasks):
                break
            if deadline is None and len(answered) >= min(self.min_clients, len(targets)):
                deadline = time.time() + self.wait_time_after_min_received
            if deadline is not None and time.time() > deadline:
                break
            answers.wake.wait(self._task_check_period)
        if not abort_signal.triggered:
            self._next_task.between_phases(answers.sites())
        status = TaskCompletionStatus.OK if targets <= answers.sites() else TaskCompletionStatus.CANCELLED
        for task in tasks:  # FLARE's monitor then drops them; a late result is ignored as an unknown task's
            if task.completion_status is None:
                self.cancel_task(task, completion_status=status, fl_ctx=fl_ctx)

    def _on_result(
        self, task_name: str, client_task: ClientTask, record: dict, evaluations: dict, fl_ctx: FLContext
    ) -> None:
        site, result = client_task.client.name, client_task.result
        rc = result.get_return_code()
        if rc != ReturnCode.OK:
            declined = result.get_header(contracts.DECLINED_HEADER)  # e.g. its DP-SGD budget is spent
            record["failed"][site] = declined_text(rc, declined)
            self.log_warning(fl_ctx, f"{site} returned {rc} for '{task_name}'; see that site's log")
            return
        try:
            dxo = from_shareable(result)
        except Exception as exc:
            record["rejected"][site] = f"not a valid DXO: {exc}"
            return
        meta = dxo.meta or {}
        record["sites"].setdefault(site, {})[RESULT_AT] = time.time() - record["started_at"]
        add_payload(record["payload"], site, dxo)
        if task_name != TASK_VALIDATE and not self.aggregator.accept(result, fl_ctx):
            return  # a rejected result contributes nothing, its evaluation included
        facts = {k: meta[k] for k in SITE_FACTS if k in meta}
        if facts:
            record["sites"].setdefault(site, {}).update(facts)
        try:
            evaluation = site_evaluation(meta, self.plan.task.num_classes, self.plan.task.multi_label)
        except Exception as exc:
            self.log_warning(fl_ctx, f"ignoring malformed evaluation statistics from {site}: {exc}")
            return
        refusal = self._declared_counts.refusal(site, evaluation) if evaluation else ""
        if refusal:
            record.setdefault("evaluation_refused", {})[site] = refusal
            self.log_warning(fl_ctx, f"medflare: {site}'s evaluation statistics refused: {refusal}")
        elif evaluation:
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
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(self.global_params, {}), private=True, sticky=True)

    def _persist_global_model(self, fl_ctx: FLContext) -> None:
        """FL_global_model.pt of the last round played, written once: every round's model is already in the
        round checkpoint (for a resumed job), so a per-round copy (fsync'ed, 45 MB for a ResNet-18) only
        lengthened each round. An encrypted job's server writes the model as it holds it, encrypted."""
        if not self.aggregator.holds_plaintext:
            self.aggregator.save_model(self.global_params, os.path.dirname(self.results_path))
            return
        self.persistor.save(make_model_learnable(self.global_params, {}), fl_ctx)

    # ----- evaluation -------------------------------------------------------------------------------
    def _record_evaluation(self, model_version: int, evaluations: dict[str, dict], fl_ctx: FLContext) -> dict:
        """Sum the sites' statistics of model ``model_version`` and keep the best model by validation."""
        summary = summarize(evaluations, self.shot_groups, share_cap=self.aggregator.core.robust.max_share)
        self._results["evaluations"][str(model_version)] = without_histograms(summary)  # "final" keeps them
        score = summary.get("val", {}).get(self.key_metric)
        if score is not None and score > self._best:
            self._best = score
            self._results["best"] = {"model_version": model_version, self.key_metric: score}
            if self.aggregator.holds_plaintext:  # the persistor saves it; an encrypted job's server cannot
                self._best_unsaved = self.global_params  # the scored model (aggregation replaces the dict)
        send_scalars(self, fl_ctx, round_scalars(summary), step=model_version)
        self._report(evaluation_entry(model_version, summary, self.key_metric), fl_ctx)
        return summary

    def _save_best_model(self, fl_ctx: FLContext) -> None:
        """Have FLARE's persistor write best_FL_global_model.pt of the model scored best and not yet saved.

        A round defers it to its housekeeping, after the next task is out: the fsync'ed write of a ResNet-18
        (~0.1 s) then overlaps the sites' work instead of delaying the next round. The persistor saves the model
        in the context's GLOBAL_MODEL, which by then is the next round's, so the scored one is put there for
        the event.
        """
        params, self._best_unsaved = self._best_unsaved, None
        if params is None:
            return
        current = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(params, {}), private=True, sticky=True)
        try:
            self.fire_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, fl_ctx)
        finally:
            fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, current, private=True, sticky=True)

    def _final_validation(self, last: RoundContext, abort_signal: Signal, fl_ctx: FLContext) -> None:
        """Score the final global model (after the last round played) at every site; its metrics land in
        ``results["final"]``."""
        version = last.round + 1
        ctx = RoundContext(
            version, self.num_rounds, stage=last.stage, stage_round=last.stage_round + 1,
            stage_rounds=last.stage_rounds, scored=True,
        )
        record = self._new_record(version, time.time())
        core = self.aggregator.core
        core.start_round(self.global_params, ctx)
        keys = core.spec.payload.shared_keys(list(self.global_params), ctx.stage)
        arrays = core.downloaded({k: self.global_params[k] for k in keys})  # in the job's download dtype
        evaluations: dict[str, dict] = {}
        self._send_phase(TASK_VALIDATE, arrays, ctx, record, evaluations, abort_signal, fl_ctx)
        final = self._record_evaluation(version, evaluations, fl_ctx)
        self._save_best_model(fl_ctx)
        method_metrics = core.rule.final_metrics(final)
        self._results["final"] = {"model_version": version, **final, "method_metrics": method_metrics}
        self._results["final_validation"] = {"wall_seconds": time.time() - record["started_at"], "failed": record["failed"]}

    # ----- state for a resumed job (FLARE's StatePersistable hooks) ----------------------------------
    def get_persist_state(self, fl_ctx: FLContext) -> dict:
        """What a resumed job needs: the next round to run, the results so far, the best score, the model."""
        return {"next_round": self._next_round, "results": self._results, "best": self._best,
                "global_params": self.global_params}

    def restore(self, state_data: dict, fl_ctx: FLContext, same_rounds: bool = True) -> None:
        """Continue from :meth:`get_persist_state` of an earlier run of the same job (same model keys/shapes;
        the same number of rounds unless ``same_rounds`` is False)."""
        params = {k: np.asarray(v) for k, v in state_data["global_params"].items()}
        differ = sorted(set(params) ^ set(self.global_params)) or sorted(
            k for k in params if params[k].shape != np.shape(self.global_params[k])
        )
        if differ:
            raise ValueError(f"the checkpoint's model differs from this job's model in {differ[:5]}")
        keys = ("method", "num_rounds") if same_rounds else ("method",)
        job = {k: state_data["results"].get(k) for k in keys}
        if job != {k: {"method": self.plan.method, "num_rounds": self.num_rounds}[k] for k in keys}:
            raise ValueError(f"the checkpoint is of another job ({job}); resume with the same method and rounds")
        self.global_params = params
        self._next_round = int(state_data["next_round"])
        self._results = dict(state_data["results"])
        self._best = float(state_data["best"])

    def _save_checkpoint(self, fl_ctx: FLContext) -> None:
        state = self.get_persist_state(fl_ctx)
        params = state.pop("global_params")
        path = os.path.join(os.path.dirname(self.results_path), CHECKPOINT_FILE)
        save_checkpoint(path, params, state, _json_default, writer=self._checkpoint_write)

    def _resume(self, fl_ctx: FLContext) -> None:
        """A job id resumes that job's checkpoint on this server; a folder (simulator only) a previous run."""
        try:
            job_id = str(uuid.UUID(self.resume_from))
        except ValueError:
            if not _in_simulator(fl_ctx):
                raise ValueError("in POC and production, resume_from must be the id of an earlier job of this "
                                 "server (a job may not make the server read a path); folders resume only in "
                                 "the simulator (medflare run --resume)") from None
            self._resume_folder(fl_ctx)
        else:
            self._resume_job(job_id, fl_ctx)
        self._progress = entries_from_results(self._results)  # watchers see the whole history

    def _resume_job(self, job_id: str, fl_ctx: FLContext) -> None:
        """Restore the last checkpoint of job ``job_id`` (same submitter) from this server's own workspace."""
        app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
        run_dir = os.path.dirname(app_root)
        previous_run = os.path.join(os.path.dirname(run_dir), job_id)
        if _submitter(previous_run) != _submitter(run_dir):
            raise ValueError(f"job {job_id} was submitted by someone else; only its submitter may resume it")
        previous_app = os.path.join(previous_run, os.path.basename(app_root))
        params, state = load_checkpoint(os.path.join(previous_app, CHECKPOINT_FILE))
        self.restore({**state, "global_params": params}, fl_ctx)
        start = {**resume.start_record(f"job {job_id}", self._next_round, self.global_params), "from_job": job_id}
        self._results["resumed"] = [*self._results.get("resumed", []), start]
        self._continue_from(previous_app, fl_ctx)

    def _resume_folder(self, fl_ctx: FLContext) -> None:
        """Continue a previous run's history and model (``medflare run --resume``; the simulator only)."""
        history = resume.read_history(self.resume_from)
        params = resume.read_model(self.resume_from)
        self.restore({"global_params": params, "next_round": len(history["rounds"]), "results": history,
                      "best": resume.best_score(history, self.key_metric)}, fl_ctx, same_rounds=False)
        start = resume.start_record(self.resume_from, self._next_round, self.global_params)
        self._results = resume.continued_results(history, self._fresh_header(), start)
        self._continue_from(self.resume_from, fl_ctx)

    def _continue_from(self, previous_app: str, fl_ctx: FLContext) -> None:
        """The resumed model becomes this job's global model; the previous best model stays the best."""
        app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
        self.persistor.save(make_model_learnable(self.global_params, {}), fl_ctx)
        if os.path.isfile(os.path.join(previous_app, BEST_MODEL_FILE)):
            shutil.copy(os.path.join(previous_app, BEST_MODEL_FILE), os.path.join(app_root, BEST_MODEL_FILE))
        self.log_info(fl_ctx, f"medflare: resuming at round {self._next_round + 1}/{self.num_rounds} "
                              f"from {self.resume_from}")

    def _write_results(self) -> None:
        tmp = self.results_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self._results, f, indent=1, default=_json_default)
        os.replace(tmp, self.results_path)  # never leave a half-written file


def add_payload(payload: dict[str, dict], site: str, dxo: DXO) -> None:
    """Accumulate what one site sent this round: array keys, meta keys and bytes (arrays + JSON meta)."""
    arrays = dxo.data or {}
    entry = payload.setdefault(site, {"arrays": 0, "meta_keys": [], "bytes": 0})
    entry["arrays"] += len(arrays)
    entry["meta_keys"] = sorted(set(entry["meta_keys"]) | set(dxo.meta or {}))
    entry["bytes"] += payload_bytes(arrays, dxo.meta or {})


def payload_bytes(arrays: dict[str, Any], meta: dict[str, Any]) -> int:
    """The bytes a task or result carries: its arrays' bytes plus its meta as JSON (no framing, no encryption)."""
    return int(sum(np.asarray(v).nbytes for v in arrays.values())) + len(json.dumps(meta, default=_json_default))


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


def _in_simulator(fl_ctx: FLContext) -> bool:
    """Whether this server is FLARE's simulator: its engine class (FLARE sets SIMULATE_MODE at simulated sites
    only). Neither can be chosen by a job's configuration."""
    from nvflare.private.fed.simulator.simulator_server import SimulatorServerEngine

    return bool(fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False)) or isinstance(fl_ctx.get_engine(),
                                                                                  SimulatorServerEngine)
