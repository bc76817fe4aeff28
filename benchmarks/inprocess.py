"""The benchmarks' in-process engine: a job's rounds through the site and server code FLARE runs, without FLARE
(saves FLARE's start-up per job on a small machine). ``mdhfl.py`` and ``ssl_fl.py`` import it by name; their
``--parity`` and ``--check-simulator`` compare it with FLARE's simulator."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from medflare import contracts
from medflare.evaluation import SiteEvaluation, site_evaluation
from medflare.flare.aggregator import RoundAggregation
from medflare.flare.models import build_global_model
from medflare.flare.tasks import TASK_VALIDATE, round_context, round_meta
from medflare.server_setup import round_plan
from medflare.methods.base import AggregateResult, PerSite, RoundContext, SiteUpdate
from medflare.run_config import RunConfig
from medflare.site_runtime import SiteRuntime, SiteSettings

Deliver = Callable[[SiteRuntime, str, dict, dict], tuple[dict, dict]]
# the global random generators a site's code may draw from: (read, restore) of each
GENERATORS = ((torch.get_rng_state, torch.set_rng_state), (np.random.get_state, np.random.set_state),
              (random.getstate, random.setstate))


class InProcessSites:
    """Every site of a run in this process (``sites``: name -> SiteRuntime), each with its own torch, numpy and
    python random state, as if it ran in its own process."""

    def __init__(self, run: RunConfig) -> None:
        task = run.task_spec()
        self.sites: dict[str, SiteRuntime] = {}
        self.rng: dict[str, list[Any]] = {}
        for index, name in enumerate(run.site_names):
            settings = SiteSettings(
                method=run.method, task=task, data=run.site_data(), model=run.site_model.get(name, run.model),
                method_args=run.method_args, train=run.train, seed=run.seed, evaluation=run.site_evaluation,
            )
            self.rng[name] = []
            with self.at(name):  # built from the caller's random state, then on its own
                self.sites[name] = SiteRuntime(settings, name, index, log=lambda message: None)

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


def run_rounds(run: RunConfig, deliver: Deliver = run_at_site, on_result: Callable[..., None] = lambda *result: None,
               on_round: Callable[[RoundDone], None] = lambda done: None) -> tuple[dict, dict[str, SiteEvaluation]]:
    """The controller's loop: the seeded global model, round by round each phase's task to every site in turn
    (a refused result raises RuntimeError), then every site's evaluation of the last model, which is returned too.

    ``deliver`` hands a site one task (name, arrays, header meta) and returns its (arrays, meta): tests pass one
    through the FLARE executor and the site's privacy filter. ``on_result(plan, site, result)`` sees each accepted
    result as it arrives, ``on_round`` each round once the server aggregated it.
    """
    run.validate()
    task = run.task_spec()
    core = RoundAggregation(run.method, run.method_args, task.num_classes, run.rounds)
    network = build_global_model(run.method, run.model, task.num_classes, task.in_channels, task.image_size,
                                 run.pretrained, run.method_args, run.seed)
    params = {k: v.detach().cpu().numpy() for k, v in network.state_dict().items()}
    sites = InProcessSites(run)
    for plan in round_plan(core.stages, run.rounds):
        started = time.perf_counter()
        core.start_round(params, dataclasses.replace(plan, server_meta=core.rule.server_meta(plan)))
        for phase in core.rule.phases(core.ctx):
            outgoing = core.start_phase(phase)
            header = {**round_meta(core.ctx), **core.task_header()}
            tasks = outgoing.arrays if isinstance(outgoing, PerSite) else {site: outgoing for site in sites.sites}
            for site, arrays in tasks.items():
                with sites.at(site) as runtime:
                    result = deliver(runtime, phase, arrays, header)
                reason = core.accept(site, *result)
                if reason:
                    raise RuntimeError(f"{site} rejected in round {plan.round + 1} ({phase}): {reason}")
                on_result(plan, site, result)
        aggregate = core.aggregate()
        params = aggregate.params
        on_round(RoundDone(plan, aggregate, core.accepted(), time.perf_counter() - started))
    last = core.stages[-1]
    final = RoundContext(run.rounds, run.rounds, stage=last.name, stage_round=last.rounds, stage_rounds=last.rounds)
    shared = {k: params[k] for k in core.spec.payload.shared_keys(list(params), last.name)}
    evaluations = {}
    for site in sites.sites:
        with sites.at(site) as runtime:
            _, meta = deliver(runtime, TASK_VALIDATE, shared, round_meta(final))
        evaluations[site] = site_evaluation(meta, task.num_classes)
    return params, evaluations
