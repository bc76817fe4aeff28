"""The in-process engine: a job's rounds through the site and server code FLARE runs, without FLARE (saves FLARE's
start-up per job on a small machine). It runs the job's own plan (``plan.resolve``, as ``medflare run`` writes it
for the simulator), builds each site as the executor does (``RunPlan.localise``) and aggregates with the round core
FLARE's aggregator drives, built from the same plan (``RoundAggregation.of_plan``).

``make test`` runs every registered method through it (tests/integration/test_every_method_inprocess.py);
``mdhfl.py`` and ``ssl_fl.py`` import it by name, and their ``--parity`` and ``--check-simulator`` compare it with
FLARE's simulator."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from medflare import contracts
from medflare.evaluation import SiteEvaluation, headline_metric, site_evaluation, summarize
from medflare.flare.models import global_model_of
from medflare.flare.run_results import RunResults, new_record
from medflare.flare.tasks import TASK_VALIDATE, round_context, round_meta
from medflare.methods.base import AggregateResult, PerSite, RoundContext, SiteUpdate
from medflare.plan import RunPlan, resolve
from medflare.run_config import RunConfig
from medflare.server_round import RoundAggregation
from medflare.site_config import SiteFile
from medflare.site_runtime import SiteRuntime

Deliver = Callable[[SiteRuntime, str, dict, dict], tuple[dict, dict]]
# the global random generators a site's code may draw from: (read, restore) of each
GENERATORS = ((torch.get_rng_state, torch.set_rng_state), (np.random.get_state, np.random.set_state),
              (random.getstate, random.setstate))


def plan_of(job: RunPlan | RunConfig) -> RunPlan:
    """The plan itself, or the plan of the job ``medflare run`` writes for FLARE's simulator from a run."""
    return job if isinstance(job, RunPlan) else resolve(job, "byoc")


class InProcessSites:
    """Every site of a plan in this process (``sites``: name -> SiteRuntime), each with its own torch, numpy and
    python random state, as if it ran in its own process. Like a site of FLARE's simulator, none has a
    ``medflare_site.json``: each takes the job's data."""

    def __init__(self, plan: RunPlan) -> None:
        self.sites: dict[str, SiteRuntime] = {}
        self.rng: dict[str, list[Any]] = {}
        for site in plan.sites:
            settings, index = plan.localise(site.name, SiteFile.of(None), simulated=True)
            self.rng[site.name] = []
            with self.at(site.name):  # built from the caller's random state, then on its own
                self.sites[site.name] = SiteRuntime(settings, site.name, index, log=lambda message: None)

    @contextlib.contextmanager
    def at(self, site: str) -> Iterator[SiteRuntime]:
        """The site, with its own random state for the duration of the block (the caller's is restored after)."""
        saved = [read() for read, _ in GENERATORS]
        for (_, restore), state in zip(GENERATORS, self.rng[site] or saved):
            restore(state)
        try:
            yield self.sites.get(site)
        finally:
            self.rng[site] = [read() for read, _ in GENERATORS]
            for (_, restore), state in zip(GENERATORS, saved):
                restore(state)


def run_at_site(runtime: SiteRuntime, task_name: str, arrays: dict, header: dict) -> tuple[dict, dict]:
    """What the site executor does with a task: its arrays and meta (validate: meta only)."""
    ctx = round_context(header)
    if task_name == TASK_VALIDATE:
        return {}, runtime.validate(arrays, ctx)
    if task_name == contracts.TRAIN_PHASE:
        return runtime.train(arrays, ctx)
    return runtime.run_phase(task_name, arrays, ctx)


@dataclasses.dataclass(frozen=True)
class RoundDone:
    """A finished round: its plan, the server's aggregate, the last phase's accepted updates, its wall seconds."""
    plan: RoundContext
    aggregate: AggregateResult
    accepted: list[SiteUpdate]
    seconds: float


def run_rounds(job: RunPlan | RunConfig, deliver: Deliver = run_at_site,
               on_result: Callable[..., None] = lambda *result: None,
               on_round: Callable[[RoundDone], None] = lambda done: None,
               on_sites: Callable[[InProcessSites], None] = lambda sites: None,
               start: tuple[int, dict] | None = None,
               results: RunResults | None = None) -> tuple[dict, dict[str, SiteEvaluation]]:
    """The controller's loop over ``job`` (a plan, or a run: :func:`plan_of`): the seeded global model, round by
    round each phase's task to every site in turn (a refused result raises RuntimeError), then every site's
    evaluation of the last model, which is returned too.

    ``deliver`` hands a site one task (name, arrays, header meta) and returns its (arrays, meta): tests pass one
    through the FLARE executor and the site's privacy filter. ``on_result(plan, site, result)`` sees each accepted
    result as it arrives, ``on_round`` each round once the server aggregated it, ``on_sites`` the sites once built
    (a resumed job restores their state there). ``start`` = (rounds done, the global model after them) resumes a
    stopped job: the rounds before it are skipped, as FLARE's controller continues a resumed job's round counter.

    ``results`` (a fresh :class:`RunResults`, or :func:`selecting` of the plan) records as FLARE's controller does:
    each scored round's pooled evaluation of the model the sites received (``site_evaluation=every_round``), the
    best model version by validation, and early stopping after ``plan.patience`` scored versions without a better
    one; the returned model is then the last one trained, as the controller's.
    """
    plan = plan_of(job)
    core = RoundAggregation.of_plan(plan)
    network = global_model_of(plan)
    params = {k: v.detach().cpu().numpy() for k, v in network.state_dict().items()}
    sites = InProcessSites(plan)
    on_sites(sites)
    done_rounds, params = start if start is not None else (0, params)
    last = None
    for ctx in plan.round_contexts():
        last = ctx
        if ctx.round < done_rounds:
            continue
        started, evaluations = time.perf_counter(), {}
        record = new_record(ctx.round, time.time())  # what the controller's record of the round would hold
        core.start_round(params, dataclasses.replace(ctx, server_meta=core.rule.server_meta(ctx)))
        for phase in core.rule.phases(core.ctx):  # as the controller: the rule names them as it runs
            outgoing = core.start_phase(phase)
            tasks = outgoing.arrays if isinstance(outgoing, PerSite) else {site: outgoing for site in sites.sites}
            _send(sites, core, phase, tasks, deliver,
                  on_result if results is None else _recording(on_result, results, record, evaluations, core))
        if results is not None and ctx.scored and evaluations:  # as the controller: the received model's scores
            results.record_evaluation(ctx.round, summarize(evaluations, plan.shot_groups,
                                                           share_cap=core.robust.max_share), None)
        aggregate = core.aggregate()
        params = aggregate.params
        on_round(RoundDone(ctx, aggregate, core.accepted(), time.perf_counter() - started))
        if results is not None and results.stop_early(ctx):
            break
    return params, _final_validation(sites, core, params, last, deliver)


def selecting(job: RunPlan | RunConfig) -> RunResults:
    """The controller's record for ``job``: its task's headline metric selects, ``plan.patience`` stops early."""
    plan = plan_of(job)
    return RunResults(headline_metric(plan.task.multi_label), plan.patience)


def _recording(on_result: Callable[..., None], results: RunResults, record: dict,
               evaluations: dict[str, SiteEvaluation], core: RoundAggregation) -> Callable[..., None]:
    """``on_result``, after ``results`` took each result's facts and evaluation statistics (into ``evaluations``)
    as the controller's record takes them (:meth:`RunResults.accept_site_result`)."""
    def accept(ctx: RoundContext, site: str, result: tuple[dict, dict]) -> None:
        results.accept_site_result(record, evaluations, site, result[1], core.num_classes, core.multi_label)
        on_result(ctx, site, result)
    return accept


def _send(sites: InProcessSites, core: RoundAggregation, phase: str, tasks: dict[str, dict], deliver: Deliver,
          on_result: Callable[..., None]) -> None:
    """One phase's task to each of its sites, in turn; every result through the server's checks."""
    header = {**round_meta(core.ctx), **core.task_header()}
    for site, arrays in tasks.items():
        with sites.at(site) as runtime:
            result = deliver(runtime, phase, arrays, header)
        reason = core.accept(site, *result)
        if reason:
            raise RuntimeError(f"{site} rejected in round {core.ctx.round + 1} ({phase}): {reason}")
        on_result(core.ctx, site, result)


def _final_validation(sites: InProcessSites, core: RoundAggregation, params: dict, last: RoundContext,
                      deliver: Deliver) -> dict[str, SiteEvaluation]:
    """Every site's evaluation of the final model, sent as the controller sends it (the model version after the
    last round, the shared keys of its stage in the job's download dtype)."""
    final = RoundContext(last.round + 1, last.total_rounds, stage=last.stage, stage_round=last.stage_round + 1,
                         stage_rounds=last.stage_rounds, scored=True)
    core.start_round(params, final)
    arrays = core.downloaded({k: params[k] for k in core.spec.payload.shared_keys(list(params), final.stage)})
    header, evaluations = {**round_meta(core.ctx), **core.task_header()}, {}
    for site in sites.sites:
        with sites.at(site) as runtime:
            _, meta = deliver(runtime, TASK_VALIDATE, arrays, header)
        evaluations[site] = site_evaluation(meta, core.num_classes, core.multi_label)  # as the controller parses
    return evaluations


def final_summary(job: RunPlan | RunConfig, evaluations: dict[str, SiteEvaluation]) -> dict[str, Any]:
    """:func:`run_rounds`' final evaluations summarised as FLARE's controller summarises them: the plan's shot
    groups and the job's ``robust.max_share`` cap on any site's say in a pooled metric."""
    plan = plan_of(job)
    present = {site: evaluation for site, evaluation in evaluations.items() if evaluation is not None}
    return summarize(present, plan.shot_groups, share_cap=RoundAggregation.of_plan(plan).robust.max_share)
