"""The site-side FLARE executor: decodes a task, hands it to SiteRuntime, encodes the declared result."""

from __future__ import annotations

import traceback

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal

from medflare import contracts
from medflare.advisories import startup_check
from medflare.distributed import DataParallelSite, site_distributed_config
from medflare.errors import ConfigError, MedflareError, SiteDeclined
from medflare.flare.memory import collect_round_garbage, freeze_startup_objects
from medflare.flare.tasks import TASK_SUBMIT_MODEL, TASK_TRAIN, TASK_VALIDATE, deployed_plan, round_context
from medflare.flare.tracking import EPOCH_LOSS, send_scalars, site_training_scalars, site_validation_scalars
from medflare.job_code import code_digest
from medflare.methods.base import LocalTrainer
from medflare.plan import PLAN_FILE, RunPlan
from medflare.plan_proof import task_refusal
from medflare.run_config import TRACKERS
from medflare.site_config import SiteFile
from medflare.site_policy import AuditLog, SitePolicy, audit_file, site_policy
from medflare.site_runtime import SiteRuntime


class MedflareExecutor(Executor):
    """Runs any registered method's local work at a site (GPU when present, else CPU): ``train`` (score the received
    model, train, return the declared payload), ``validate`` (score only), ``submit_model`` and any method-specific
    phase (the trainer's ``run_phase``). A site whose ``local/medflare_site.json`` asks for several processes
    trains data-parallel (:mod:`medflare.distributed`) and still sends one update.

    Args:
        plan_file: the job's plan in its ``app/config`` folder (:mod:`medflare.plan`), localised by the site's own
            ``local/medflare_site.json`` (its data, DP-SGD and architecture). The executor takes nothing else.
    """

    def __init__(self, plan_file: str = PLAN_FILE) -> None:
        super().__init__()
        self.plan_file = plan_file
        self._plan: RunPlan | None = None  # loaded at the first task
        self._plan_digest = ""  # its fingerprint: every task's server plan must be it, every result carries it
        self._policy = SitePolicy()  # the hospital's, read at the first task (the simulator's: the default)
        self._runtime: SiteRuntime | DataParallelSite | None = None
        self._declined: SiteDeclined | None = None  # once the site declined this job, every task gets it
        self._audit: AuditLog | None = None  # the site's audit record of this job (a site with its own file)
        # the last task whose curves wait for its filtered result (FLARE's AFTER_TASK_RESULT_FILTER event)
        self._unstreamed_task: tuple[SiteRuntime | DataParallelSite, str, Shareable] | None = None

    def use_plan(self, plan: RunPlan) -> MedflareExecutor:
        """Run ``plan`` (at the first task from the job's plan file; a test may hand one in)."""
        self._plan = plan
        return self

    @property
    def stream_metrics(self) -> bool:
        """Whether the job tracks experiments: the site then streams its curves (:mod:`medflare.flare.tracking`)."""
        return self._plan is not None and bool(TRACKERS[self._plan.tracking])

    def _get_runtime(self, fl_ctx: FLContext) -> SiteRuntime | DataParallelSite:
        if self._declined is not None:
            raise self._declined
        if self._runtime is None:
            site = fl_ctx.get_identity_name()
            workspace = fl_ctx.get_engine().get_workspace()
            site_file = SiteFile.of(workspace.get_site_config_dir())  # the hospital's own settings, read once
            # the job's plan as FLARE deployed it; the site's own file decides its data, DP-SGD and architecture
            if self._plan is None:
                self._plan, loaded = deployed_plan(fl_ctx, self.plan_file)
                self.log_info(fl_ctx, f"{site}: {loaded}")
            plan = self._plan
            self._check_platform(site, plan, fl_ctx)
            code = code_digest(workspace.get_app_custom_dir(fl_ctx.get_job_id()))  # what FLARE deployed here
            self.log_info(fl_ctx, f"{site}: the job's code is {code}")
            policy = self._check_policy(site, site_file, plan, fl_ctx.get_job_id(), code)
            self._plan_digest, self._policy = plan.digest(), policy
            # FLARE's simulator sets SIMULATE_MODE (private, sticky); a job's configuration cannot.
            settings, index = plan.localise(site, site_file, fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False))
            settings.min_class_samples = policy.min_class_samples
            log = lambda msg: self.log_info(fl_ctx, f"{site}: {msg}")  # noqa: E731
            local_dir = workspace.get_app_dir(fl_ctx.get_job_id())
            parallel = site_distributed_config(site_file)  # a multi-GPU site asks for several processes
            if parallel.processes > 1 and settings.dp_sgd:
                raise ConfigError(f"{site}: dp_sgd trains on one process per site (one accountant, one Poisson "
                                  "sampler); set distributed.processes to 1 in local/medflare_site.json")
            if parallel.processes > 1:
                self._runtime = DataParallelSite(settings, site, index, parallel, log, local_dir=local_dir)
            else:
                self._runtime = SiteRuntime(settings, site, index, log=log, local_dir=local_dir)
            freeze_startup_objects()
        return self._runtime

    def _check_platform(self, site: str, plan: RunPlan, fl_ctx: FLContext) -> None:
        """Decline the job on a FLARE release with known advisories (:mod:`medflare.advisories`), in the simulator
        too; warn when this site runs another release than the job was exported with."""
        unsafe, warning = startup_check(site, plan.nvflare)
        if unsafe:
            self._declined = SiteDeclined(f"{site} declines the job: {unsafe}", reason="platform")
            raise self._declined
        if warning:
            self.log_warning(fl_ctx, warning)

    def _check_policy(self, site: str, site_file: SiteFile, plan: RunPlan, job_id: str, code: str) -> SitePolicy:
        """The hospital's policy (``medflare.site_policy``; the default one in FLARE's simulator) against the job and
        the digest of the ``code`` it brought, before any image is read, raising :class:`SiteDeclined` when it
        refuses; a site with its own file keeps an audit record of the job (its refusal included)."""
        policy = site_policy(site_file)
        if site_file.content is None:  # FLARE's simulator: no hospital, no policy
            return policy
        self._audit = AuditLog(audit_file(site_file.path.parent, policy.audit_log), job_id, plan)
        reason, word = policy.refusal(plan), "policy"
        if not reason:
            reason, word = policy.code_refusal(code), "code"
        if reason:
            self._declined = SiteDeclined(f"{site} declines the job: {reason} (its medflare_site.json policy)",
                                          reason=word)
            self._audit.decided("declined", reason)
            self._audit = None
            raise self._declined
        self._audit.decided("accepted")  # on disk before any image is read
        return policy

    def _check_server_plan(self, site: str, task: Shareable) -> None:
        """Decline (:class:`SiteDeclined`) a task whose server runs another plan, declares weaker defences than this
        site's policy requires, or proves nothing (:mod:`medflare.plan_proof`)."""
        try:
            meta = from_shareable(task).meta or {}
        except ValueError:  # not a DXO: it carries no proof
            meta = {}
        refusal = task_refusal(self._plan, self._plan_digest, self._policy, meta)
        if refusal is not None:
            raise SiteDeclined(f"{site} declines the task: {refusal.detail} ({refusal.reason})", reason=refusal.reason)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.END_RUN:
            if self._audit is not None:
                self._audit.close()
                self._audit = None
            if self._runtime is not None:
                self._runtime.close()
        if event_type == EventType.AFTER_SEND_TASK_RESULT:
            # the upload left FLARE's stream objects in reference cycles; collected while the site waits for its
            # next task, not at the start of it, where it delayed every round by ~0.15 s (ResNet-18, 2 sites)
            collect_round_garbage()
        if event_type == EventType.AFTER_TASK_RESULT_FILTER and self._unstreamed_task is not None:
            # the site's result filters have run: stream from what the site lets leave, not from what it computed
            (runtime, task_name, task), self._unstreamed_task = self._unstreamed_task, None
            filtered = fl_ctx.get_prop(FLContextKey.TASK_RESULT)
            if isinstance(filtered, Shareable):
                self._audit_task(task_name, task, filtered)
                self._stream_task(runtime, task_name, task, filtered, fl_ctx)
        super().handle_event(event_type, fl_ctx)

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = fl_ctx.get_identity_name()
        try:
            refused = shareable.get_header(contracts.REFUSED_TASK_HEADER)
            if refused:  # a task filter of this site refused what the task carries (e.g. he.DecryptTask)
                raise SiteDeclined(f"{site} refuses the task: {refused}", reason="implausible_model")
            runtime = self._get_runtime(fl_ctx)
            self._check_server_plan(site, shareable)
            if self.stream_metrics:  # the trainer's per-epoch report, as FLARE analytics events of this task
                _trainer(runtime).epoch_listener = (
                    lambda epoch, loss: send_scalars(self, fl_ctx, {EPOCH_LOSS: loss}, epoch))
            result = self._dispatch(runtime, task_name, shareable, abort_signal)
            result.set_header(contracts.SITE_PLAN_HEADER, self._plan_digest)  # the server compares it with its own
            self._unstreamed_task = (runtime, task_name, shareable)  # streamed once FLARE has filtered the result
            return result
        except SiteDeclined as exc:  # the site's own policy: its one-line reason is what the server records
            self.log_error(fl_ctx, f"{site}: task '{task_name}' declined: {exc}")
            self._audit_failure(task_name, exc)
            reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            reply.set_header(contracts.DECLINED_HEADER, exc.reason)  # a word of DECLINE_REASONS, no free text
            return reply
        except MedflareError as exc:
            self.log_error(fl_ctx, f"{site}: task '{task_name}' failed: {exc}")
            self._audit_failure(task_name, exc)
        except Exception as exc:  # the site must answer the server, whatever broke
            self.log_error(fl_ctx, f"{site}: task '{task_name}' crashed: {exc}\n{traceback.format_exc()}")
            self._audit_failure(task_name, exc)
        return make_reply(ReturnCode.EXECUTION_EXCEPTION)

    def _audit_failure(self, task_name: str, exc: BaseException) -> None:
        """A task the site could not do or declined, in its audit log (which stays at the site)."""
        if self._audit is not None:
            self._audit.failed(task_name, f"{type(exc).__name__}: {exc}")

    def _audit_task(self, task_name: str, task: Shareable, result: Shareable) -> None:
        """What left the site in a task's result, as its filters let it out, for the audit log."""
        if self._audit is None or result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return
        try:
            sent, received = from_shareable(result), from_shareable(task)
        except ValueError:  # a filter made it something other than a DXO: nothing medflare can name
            return
        self._audit.task(task_name, round_context(received.meta).round, sent.data or {}, sent.meta or {})

    def _stream_task(self, runtime: SiteRuntime | DataParallelSite, task_name: str, task: Shareable,
                     result: Shareable, fl_ctx: FLContext) -> None:
        """The site's curves from a finished train or validate task (when tracking): the received model's
        validation metrics at its version, the round's training loss, seconds and lr at the round (from 1). Every
        value comes from the result as the site's filters left it (a filter that strips a value strips it from the
        stream); a tracking problem is logged, never the task's failure."""
        done = result.get_return_code(ReturnCode.OK) == ReturnCode.OK
        if not self.stream_metrics or not done or task_name not in (TASK_TRAIN, TASK_VALIDATE) or self._plan is None:
            return
        try:
            ctx, meta = round_context(from_shareable(task).meta), from_shareable(result).meta
        except ValueError as exc:  # a site filter made the result something other than a DXO: nothing to read
            self.log_warning(fl_ctx, f"site curves not streamed: {exc}")
            return
        task = self._plan.task
        try:
            send_scalars(self, fl_ctx, site_validation_scalars(meta, task.num_classes, task.multi_label), ctx.round)
        except MedflareError as exc:
            self.log_warning(fl_ctx, f"validation metrics not streamed: {exc}")
        if task_name == TASK_TRAIN:
            scalars = site_training_scalars(meta, _learning_rate(_trainer(runtime)))
            send_scalars(self, fl_ctx, scalars, ctx.round + 1)

    def _dispatch(self, runtime: SiteRuntime | DataParallelSite, task_name: str, shareable: Shareable,
                  abort_signal: Signal) -> Shareable:
        dxo = from_shareable(shareable)
        ctx = round_context(dxo.meta)
        if task_name == TASK_VALIDATE:
            return DXO(DataKind.METRICS, data={}, meta=runtime.validate(dxo.data, ctx)).to_shareable()
        if task_name == TASK_SUBMIT_MODEL:
            return DXO(DataKind.WEIGHTS, data=runtime.shared_weights(), meta={}).to_shareable()
        if task_name == TASK_TRAIN:
            arrays, meta = runtime.train(dxo.data, ctx, lambda: abort_signal.triggered)
        else:  # a method-specific phase, e.g. a public-set logit exchange
            arrays, meta = runtime.run_phase(task_name, dxo.data, ctx)
        if abort_signal.triggered:
            return make_reply(ReturnCode.TASK_ABORTED)
        diff = task_name == TASK_TRAIN and ctx.server_meta.get(contracts.TRANSFER_KIND) == "diff"
        return DXO(DataKind.WEIGHT_DIFF if diff else DataKind.WEIGHTS, data=arrays, meta=meta).to_shareable()


def _trainer(runtime: SiteRuntime | DataParallelSite) -> LocalTrainer:
    """The trainer of this process (a data-parallel site's rank 0)."""
    return (runtime.runtime if isinstance(runtime, DataParallelSite) else runtime).trainer


def _learning_rate(trainer: LocalTrainer) -> float | None:
    """The largest lr of the trainer's parameter groups (layer-wise decay scales the others down), if it trained."""
    groups = trainer.optimizer.param_groups if trainer.optimizer is not None else []
    return max((float(group["lr"]) for group in groups), default=None)
