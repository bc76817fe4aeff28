"""The server-side FLARE controller: one round loop for every method (send, accept validated results, aggregate, record
and checkpoint). Sites score the model they receive before training, so round r's results carry the evaluation of model
r; a final ``validate`` task scores the last model."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
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

from medflare import contracts
from medflare.advisories import startup_check
from medflare.errors import MedflareError, PayloadError
from medflare.evaluation import headline_metric, summarize
from medflare.flare import progress, resume_state, run_results
from medflare.flare.aggregator import MedflareAggregator
from medflare.flare.memory import collect_round_garbage, freeze_startup_objects
from medflare.flare.resume_state import CHECKPOINT_FILE  # noqa: F401  (where tests and tools find it)
from medflare.flare.run_results import RESULTS_FILE, TASK_BYTES, RunResults, declined_text
from medflare.flare.tasks import TASK_VALIDATE, deployed_plan, round_meta
from medflare.flare.tracking import record_scalars, round_scalars, send_scalars
from medflare.methods.base import PerSite, RoundContext
from medflare.ops.background import BackgroundWrite
from medflare.ops.timing import timed
from medflare.plan import PLAN_FILE, RunPlan
from medflare.plan_proof import server_proof, site_plan_refusal
from medflare.server_round import INFO, SHARES

# The longest a site's request for its next task is held between two phases (then it hears "try again"): longer than
# the server's usual turn (0.1-0.3 s), short enough for FLARE's heartbeats, waiting for the same lock, to stay in time.
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
    """Holds a site's request for its next task while the server works between two phases: told "try again", a site
    waits a whole poll period (0.5 s in FLARE's simulator, ``task_request_interval`` in POC and production). A request
    of a site that answered the phase (``BEFORE_PROCESS_TASK_REQUEST``) waits here instead, at most ``limit`` s. It runs
    under FLARE's workflow lock, which result submissions also take: only when no result of the phase is outstanding.
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


class MedflareController(Controller):
    """Round loop shared by all methods. ``plan_file``: the job's plan in its ``app/config`` folder
    (:mod:`medflare.plan`), read when the job starts (rounds, ``min_clients``, ``straggler_seconds`` once those
    answered, a failed site counting as an answer, ``task_timeout``, ``shot_groups``, ``patience``, ``resume_from``);
    ``persistor_id``/``aggregator_id``: component ids of the MedflareModelPersistor and the MedflareAggregator."""

    def __init__(self, plan_file: str = PLAN_FILE, persistor_id: str = "persistor",
                 aggregator_id: str = "aggregator") -> None:
        super().__init__(task_check_period=0.05)
        self.plan_file = plan_file
        self.persistor_id = persistor_id
        self.aggregator_id = aggregator_id
        self.plan: RunPlan | None = None  # the job's, loaded at START_RUN (before start_controller)
        self.plan_digest = ""  # its fingerprint: every task proves it, every site's result must carry it
        self.plan_proof: dict[str, Any] = {}  # what every task carries to prove it, fixed by start_controller
        self.results = RunResults("")  # the run's record, made for the plan by use_plan
        self._progress: list[dict[str, Any]] = []  # what show_stats serves to `medflare watch`
        self._checkpoint_write = BackgroundWrite("medflare-checkpoint")  # written while the sites train
        self._housekeeping: Callable[[], None] | None = None  # the last round's _close_round, until it ran
        self._next_task = NextTaskHold()

    def use_plan(self, plan: RunPlan) -> MedflareController:
        """Run ``plan`` (at START_RUN from the job's plan file; a test may hand one in)."""
        self.plan, self.plan_digest = plan, plan.digest()
        self.num_rounds, self.min_clients = len(plan.rounds), plan.min_clients
        self.wait_time_after_min_received, self.train_timeout = plan.straggler_seconds, plan.task_timeout
        self.shot_groups, self.resume_from = plan.shot_groups, plan.resume_from
        self.results = RunResults(headline_metric(plan.task.multi_label), plan.patience)
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
        unsafe, warning = startup_check("the server", self.plan.nvflare)
        if unsafe:
            self.system_panic(f"medflare: {unsafe}", fl_ctx)
            return
        if warning:
            self.log_warning(fl_ctx, f"medflare: {warning}")
        self.plan_proof = self._plan_proof()
        learnable = self.persistor.load(fl_ctx)
        self.global_params = {k: np.asarray(v) for k, v in learnable[ModelLearnableKey.WEIGHTS].items()}
        self.results_path = os.path.join(fl_ctx.get_prop(FLContextKey.APP_ROOT), RESULTS_FILE)
        self.results.data = run_results.results_header(self.plan, self.aggregator)
        freeze_startup_objects()
        if self.resume_from:
            try:
                self._resume(fl_ctx)
            except (OSError, KeyError, ValueError, MedflareError) as exc:
                self.system_panic(f"medflare: cannot resume from '{self.resume_from}': {exc}", fl_ctx)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN and self.plan is None:
            self._load_plan(fl_ctx)
        elif event_type == InfoCollector.EVENT_TYPE_GET_STATS:  # FLARE's show_stats: progress for medflare watch
            collector = fl_ctx.get_prop(InfoCollector.CTX_KEY_STATS_COLLECTOR, None)
            if isinstance(collector, GroupInfoCollector):
                collector.add_info(progress.STATS_GROUP, {"num_rounds": self.num_rounds,
                                                          "progress": list(self._progress)})
        elif event_type == EventType.BEFORE_PROCESS_TASK_REQUEST:
            peer = fl_ctx.get_peer_context()
            self._next_task.hold(peer.get_identity_name() if peer is not None else None)
        super().handle_event(event_type, fl_ctx)

    def _load_plan(self, fl_ctx: FLContext) -> None:
        """The job's plan as FLARE deployed it; its fingerprint goes into the log, beside each site's."""
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

    def process_result_of_unknown_task(self, client: Client, task_name: str, client_task_id: str, result: Any,
                                       fl_ctx: FLContext) -> None:
        self.log_warning(fl_ctx, f"ignoring a late '{task_name}' result from {client.name}")

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        results = self.results.data
        try:
            stages = self.aggregator.core.stages
            results["stages"] = [dataclasses.asdict(stage) for stage in stages]
            last = None
            schedule = self.plan.round_contexts()  # the plan's rounds, decided once when the job was resolved
            for ctx in schedule[self.results.next_round:]:  # a resumed job skips some
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
            self._final_validation(last or schedule[-1], abort_signal, fl_ctx)
            self._checkpoint_write.wait()  # the last round's checkpoint is complete before the job ends
            results["finished_at"] = time.time()
            self._write_results()
            # no path: in the simulator this workspace is a staging folder that is gone once the run's outputs
            # are in place (the launcher prints where they are)
            self.log_info(fl_ctx, f"medflare: finished {len(results['rounds'])} rounds; {RESULTS_FILE} "
                                  "written in the job's app_server folder")
        except Exception as exc:
            results["error"] = str(exc)
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
        record = {**run_results.new_record(ctx.round, started), "stage": ctx.stage}
        evaluations: dict[str, dict] = {}
        # the rule names the round's phases as it runs: the plan records a fresh rule's, and a stateful rule adds
        # one where it lacks what it needs (FedLSM's label_counts set-up again after a resume)
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
        self.results.finish_round(record)
        with timed(spans, "results_file"):  # before the next round: a crash or SIGTERM still finds this round
            self._write_results()
        self.fire_event(AppEventType.ROUND_DONE, fl_ctx)
        self._housekeeping = lambda: self._close_round(record, fl_ctx)  # runs once the next task is out
        self._track(progress.round_entry(record, self.num_rounds), fl_ctx, record_scalars(record), ctx.round + 1)

    def _close_round(self, record: dict, fl_ctx: FLContext) -> None:
        """The round's best model, checkpoint and garbage collection, run once the next task is out: a server busy
        with them when a site polls for that task would cost it a whole poll interval."""
        spans = record["server_seconds"]
        with timed(spans, "best_model"):  # before the checkpoint, which names the best model version
            self._save_best_model(fl_ctx)
        with timed(spans, "checkpoint"):  # recorded in the next write (the last round's: in the final one)
            if self.aggregator.holds_plaintext:  # an encrypted job's server holds ciphertexts: no resume point
                resume_state.save_round_checkpoint(os.path.dirname(self.results_path), self.results,
                                                   self.global_params, self._checkpoint_write,
                                                   getattr(self.aggregator.core, "server_opt", None),
                                                   getattr(self.aggregator.core, "rule", None))
        with timed(spans, "gc"):  # FLARE's transfers of this round sit in reference cycles (flare/memory.py)
            record["gc_objects_freed"] = collect_round_garbage()

    def _run_housekeeping(self) -> None:
        """The last round's deferred :meth:`_close_round`, if it has not run yet."""
        pending, self._housekeeping = self._housekeeping, None
        if pending is not None:
            pending()

    def _track(self, entry: dict | None, fl_ctx: FLContext, scalars: dict | None = None, step: int = 0) -> None:
        """Send ``scalars`` as FLARE analytics events; log a progress entry and keep it for show_stats."""
        if scalars:
            send_scalars(self, fl_ctx, scalars, step=step)
        if entry is not None:
            self._progress.append(entry)
            self.log_info(fl_ctx, f"medflare: {progress.format_progress(entry)}")

    def _stopping_early(self, ctx: RoundContext, fl_ctx: FLContext) -> bool:
        stopped = self.results.stop_early(ctx)
        if stopped is not None:
            self._track(progress.stop_entry(stopped), fl_ctx)
        return stopped is not None

    def _require_enough_sites(self, round_index: int, phase: str, record: dict) -> None:
        core = self.aggregator.core
        record["rejected"].update(core.rejected)
        accepted = len(core.updates)
        if accepted < self.min_clients:
            self.results.fail_round(record, phase)
            raise RuntimeError(
                f"round {round_index + 1} ({phase}): only {accepted} site(s) sent a valid result, the job needs "
                f"min_clients={self.min_clients}. Failed: {run_results.sites_text(record['failed'])}; rejected: "
                f"{run_results.sites_text(record['rejected'])}. Check those sites' logs, or lower min_clients.")

    def _send_phase(self, phase: str, outgoing: dict | PerSite, ctx: RoundContext, record: dict,
                    evaluations: dict[str, dict], abort_signal: Signal, fl_ctx: FLContext) -> None:
        """Send a phase's task (one broadcast, or one task per site) and collect results as they arrive."""
        header = {**round_meta(ctx), **self.aggregator.core.task_header(), **self.plan_proof}
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
        record.setdefault(TASK_BYTES, {})[phase] = max((run_results.payload_bytes(a, header) for a in sent), default=0)
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

    def _plan_proof(self) -> dict[str, Any]:
        """What every task carries to prove the server's plan: its fingerprint and the defences this server's
        aggregator runs with (:mod:`medflare.plan_proof`)."""
        return server_proof(self.plan_digest, self.aggregator.core.robust, self.min_clients,
                            not self.aggregator.holds_plaintext)

    def _wait_for_answers(self, tasks: list[Task], answers: PhaseAnswers, abort_signal: Signal,
                          fl_ctx: FLContext) -> None:
        """Wait with ``broadcast_and_wait``'s rules (stragglers get ``wait_time_after_min_received`` once
        ``min_clients`` answered; a task FLARE ends itself counts as answered), but go on the moment the last result
        is processed: FLARE's own wait polls twice in a row, about 0.2 s per phase (docs/benchmarks.md)."""
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

    def _on_result(self, task_name: str, client_task: ClientTask, record: dict, evaluations: dict,
                   fl_ctx: FLContext) -> None:
        site, result = client_task.client.name, client_task.result
        rc = result.get_return_code()
        if rc != ReturnCode.OK:
            declined = result.get_header(contracts.DECLINED_HEADER)  # e.g. its DP-SGD budget is spent
            record["failed"][site] = declined_text(rc, declined)
            self.log_warning(fl_ctx, f"{site} returned {rc} for '{task_name}'; see that site's log")
            return
        site_plan = result.get_header(contracts.SITE_PLAN_HEADER)
        self.results.data.setdefault("site_plans", {})[site] = site_plan if isinstance(site_plan, str) else None
        other_plan = site_plan_refusal(site, site_plan, self.plan_digest)
        if other_plan:  # the site trained another job: nothing of it is aggregated or scored
            record["rejected"][site] = other_plan
            self.log_warning(fl_ctx, f"medflare: REFUSED the '{task_name}' result of {other_plan}")
            return
        try:
            dxo = from_shareable(result)
        except Exception as exc:
            record["rejected"][site] = f"not a valid DXO: {exc}"
            return
        run_results.note_arrival(record, site, dxo.data or {}, dxo.meta or {})
        if task_name != TASK_VALIDATE and not self.aggregator.accept(result, fl_ctx):
            return  # a rejected result contributes nothing, its evaluation included
        task = self.plan.task
        try:
            refusal = self.results.accept_site_result(record, evaluations, site, dxo.meta or {}, task.num_classes,
                                                  task.multi_label)
        except Exception as exc:
            self.log_warning(fl_ctx, f"ignoring malformed evaluation statistics from {site}: {exc}")
            return
        if refusal:
            self.log_warning(fl_ctx, f"medflare: {site}'s evaluation statistics refused: {refusal}")

    def _aggregate(self, record: dict, fl_ctx: FLContext) -> None:
        self.fire_event(AppEventType.BEFORE_AGGREGATION, fl_ctx)
        try:
            dxo = from_shareable(self.aggregator.aggregate(fl_ctx))
        except PayloadError as exc:  # nothing to aggregate, or a non-finite aggregate: keep the last model
            record["aggregation_error"] = str(exc)
            self.log_error(fl_ctx, f"medflare: round {record['round'] + 1}: {exc}")
            return
        finally:
            record["rejected"].update(self.aggregator.core.rejected)  # includes robust-rule rejections
        self.global_params = dict(dxo.data)
        record["share"] = dxo.meta[SHARES]
        record.update(dxo.meta[INFO])
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(self.global_params, {}), private=True, sticky=True)

    def _persist_global_model(self, fl_ctx: FLContext) -> None:
        """FL_global_model.pt of the last round played, written once (each round's model is in its checkpoint); an
        encrypted job's server writes the model as it holds it, encrypted."""
        if not self.aggregator.holds_plaintext:
            self.aggregator.save_model(self.global_params, os.path.dirname(self.results_path))
            return
        self.persistor.save(make_model_learnable(self.global_params, {}), fl_ctx)

    # ----- evaluation -------------------------------------------------------------------------------
    def _record_evaluation(self, model_version: int, evaluations: dict[str, dict], fl_ctx: FLContext) -> dict:
        """Sum the sites' statistics of model ``model_version`` and keep the best model by validation."""
        summary = summarize(evaluations, self.shot_groups, share_cap=self.aggregator.core.robust.max_share)
        # the persistor saves the scored model (aggregation replaces the dict); an encrypted job's server cannot
        self.results.record_evaluation(model_version, summary,
                                       self.global_params if self.aggregator.holds_plaintext else None)
        entry = progress.evaluation_entry(model_version, summary, self.results.key_metric)
        self._track(entry, fl_ctx, round_scalars(summary), model_version)
        return summary

    def _save_best_model(self, fl_ctx: FLContext) -> None:
        """Have FLARE's persistor write best_FL_global_model.pt of the model scored best and not yet saved. Deferred
        to the round's housekeeping, so the write (~0.1 s, ResNet-18) overlaps the sites' work; by then the context's
        GLOBAL_MODEL, which the persistor saves, is the next round's, so the scored one is put there."""
        params, self.results.best_unsaved = self.results.best_unsaved, None
        if params is None:
            return
        current = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(params, {}), private=True, sticky=True)
        try:
            self.fire_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, fl_ctx)
        finally:
            fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, current, private=True, sticky=True)

    def _final_validation(self, last: RoundContext, abort_signal: Signal, fl_ctx: FLContext) -> None:
        """Score the last round's model at every site (``results["final"]``)."""
        version = last.round + 1
        ctx = RoundContext(version, self.num_rounds, stage=last.stage, stage_round=last.stage_round + 1,
                           stage_rounds=last.stage_rounds, scored=True)
        record = run_results.new_record(version, time.time())
        core = self.aggregator.core
        core.start_round(self.global_params, ctx)
        keys = core.spec.payload.shared_keys(list(self.global_params), ctx.stage)
        arrays = core.downloaded({k: self.global_params[k] for k in keys})  # in the job's download dtype
        evaluations: dict[str, dict] = {}
        self._send_phase(TASK_VALIDATE, arrays, ctx, record, evaluations, abort_signal, fl_ctx)
        final = self._record_evaluation(version, evaluations, fl_ctx)
        self._save_best_model(fl_ctx)
        self.results.data["final"] = {"model_version": version, **final,
                                      "method_metrics": core.rule.final_metrics(final)}
        self.results.data["final_validation"] = {"wall_seconds": time.time() - record["started_at"],
                                             "failed": record["failed"]}

    # ----- a resumed job (medflare.flare.resume_state) -----------------------------------------------
    def _resume(self, fl_ctx: FLContext) -> None:
        """A job id resumes that job's checkpoint on this server; a folder (simulator only) a previous run. The
        resumed model becomes this job's global model; the previous best model stays the best."""
        app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
        job_id = resume_state.resumed_job_id(self.resume_from, resume_state.in_simulator(fl_ctx))
        if job_id is None:
            self._resume_folder(fl_ctx)
            previous_app = self.resume_from
        else:
            self.global_params, previous_app = resume_state.resume_job(
                self.results, job_id, app_root, self.global_params, self.plan.method, self.num_rounds,
                getattr(self.aggregator.core, "server_opt", None), getattr(self.aggregator.core, "rule", None))
        self.persistor.save(make_model_learnable(self.global_params, {}), fl_ctx)
        resume_state.carry_best_model(previous_app, app_root)
        self._progress = progress.entries_from_results(self.results.data)  # watchers see the whole history
        self.log_info(fl_ctx, f"medflare: resuming at round {self.results.next_round + 1}/{self.num_rounds} "
                              f"from {self.resume_from}")

    def _resume_folder(self, fl_ctx: FLContext) -> None:
        """Continue a previous run's history and model (``medflare run --resume``; the simulator only)."""
        self.global_params = resume_state.resume_folder(self.results, self.resume_from, self.global_params,
                                                        run_results.results_header(self.plan, self.aggregator))

    def _write_results(self) -> None:
        self.results.write(self.results_path)
