"""The site's privacy filter (PayloadGuard) lets every real MDH-FL and FedMD result through, for every task the
job sends, and refuses a result that carries what the server never sent.

Each task goes the way FLARE takes it: the controller's task data, the site executor's encoding of the site's
real result, then the guard with the job's real client config, the task's name and the task's data.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from medflare.console.job_export import task_names
from medflare.deploy.filters import PayloadGuard
from medflare.errors import PayloadError
from medflare.flare.executor import MedflareExecutor
from medflare.flare.tasks import TASK_SUBMIT_MODEL
from medflare.methods.mdhfl.protocol import PROBS, PROBS_PHASE
from medflare.plan import resolve
from medflare.run_config import RunConfig
from medflare.site_runtime import SiteRuntime

from .._plans import deploy_plan, run_plan

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "mdhfl.py"
SITE_MODELS = {"site-1": "cnn", "site-2": "shufflenet", "site-3": "cnn"}  # two architectures, kept small


@pytest.fixture(scope="module")
def bench() -> SimpleNamespace:
    """The benchmark script's in-process engine (the controller's round loop without FLARE) and its sites."""
    engine = runpy.run_path(str(BENCHMARK.with_name("inprocess.py")))
    return SimpleNamespace(**{**engine, **runpy.run_path(str(BENCHMARK))})


def small_run(method: str, probs_dtype: str) -> RunConfig:
    return RunConfig(
        method=method, rounds=2, clients=3, model="cnn", site_model=SITE_MODELS, site_evaluation="final",
        data={"source": "synthetic:n=150,classes=3,n_val=12,n_test=12,size=16", "public_fraction": 0.2,
              "augment": "none", "label_noise": 0.2, "noise_kind": "pairflip"},
        train={"max_steps": 1, "batch_size": 4},
        method_args={"chunks": 2, "public_per_round": 8, "probs_dtype": probs_dtype},
    )


class GuardedSite:
    """Delivers tasks the way FLARE does: task shareable -> executor -> the site's PayloadGuard -> the server."""

    def __init__(self, run: RunConfig, app: Path) -> None:
        self.app = deploy_plan(app, run_plan(run))
        self.executor = MedflareExecutor()
        self.guard = PayloadGuard()  # the default scope's guard: reads the method from the job's config
        self.guarded: dict[str, set[str]] = {}  # task name -> dtypes of the arrays that passed
        self.tamper = False  # add an array the server never sent to every result

    def __call__(self, runtime: SiteRuntime, task_name: str, arrays: dict, header: dict) -> tuple[dict, dict]:
        task = DXO(DataKind.WEIGHTS, data=arrays, meta=header).to_shareable()
        result = self.executor._dispatch(runtime, task_name, task, Signal())
        assert result.get_return_code(ReturnCode.OK) == ReturnCode.OK
        if self.tamper:
            dxo = from_shareable(result)
            dxo.data = {**(dxo.data or {}), "conv.weight": np.zeros((4, 3), np.float32)}
            result = dxo.to_shareable()
        assert self.guard.process(result, self.context(task_name, task)) is result
        dxo = from_shareable(result)
        self.guarded.setdefault(task_name, set()).update(str(a.dtype) for a in (dxo.data or {}).values())
        return dict(dxo.data or {}), dict(dxo.meta or {})

    def context(self, task_name: str, task: Shareable) -> FLContext:
        """What FLARE gives a site's result filter: the job's folder, the task's name and the task's data."""
        ctx = FLContext()
        ctx.set_prop(FLContextKey.APP_ROOT, str(self.app), private=True, sticky=False)
        ctx.set_prop(FLContextKey.TASK_NAME, task_name, private=True, sticky=False)
        ctx.set_prop(FLContextKey.TASK_DATA, task, private=True, sticky=False)
        return ctx


@pytest.mark.parametrize(("method", "probs_dtype"), [("mdhfl", "float16"), ("mdhfl", "float32"),
                                                      ("fedmd", "float16")])
def test_every_real_result_of_the_exchange_passes_the_site_guard(bench: SimpleNamespace, tmp_path: Path, method: str,
                                                                 probs_dtype: str) -> None:
    run = small_run(method, probs_dtype)
    site = GuardedSite(run, tmp_path / "app")
    summary = bench.run_in_process(run, deliver=site)

    assert set(site.guarded) == set(task_names(resolve(run))) - {TASK_SUBMIT_MODEL}  # every task the job sends
    assert site.guarded[PROBS_PHASE] == {probs_dtype}  # the probabilities passed the value checks
    assert all(not dtypes for name, dtypes in site.guarded.items() if name != PROBS_PHASE)
    assert set(summary["by_site"]) == set(SITE_MODELS)
    runtime = bench.InProcessSites(bench.plan_of(run)).sites["site-1"]
    submitted = site.executor._dispatch(runtime, TASK_SUBMIT_MODEL, DXO(DataKind.WEIGHTS, data={}).to_shareable(),
                                        Signal())
    assert site.guard.process(submitted, site.context(TASK_SUBMIT_MODEL, Shareable())) is submitted
    assert from_shareable(submitted).data == {}  # a model-free method submits no model


def test_the_guard_refuses_a_result_carrying_an_array_the_server_never_sent(bench: SimpleNamespace,
                                                                            tmp_path: Path) -> None:
    run = small_run("mdhfl", "float16")
    site = GuardedSite(run, tmp_path / "app")
    site.tamper = True
    with pytest.raises(PayloadError, match="conv.weight"):
        bench.run_in_process(run, deliver=site)


def test_the_guard_refuses_probabilities_of_another_chunk_size(bench: SimpleNamespace, tmp_path: Path) -> None:
    """The rows the server's task declared (array_dims) bind the site's answer, not only the class count."""
    run = small_run("mdhfl", "float16")
    site = GuardedSite(run, tmp_path / "app")
    header = {"array_dims": {"rows": 4}}
    task = DXO(DataKind.WEIGHTS, data={}, meta=header).to_shareable()
    uniform = np.full((5, 3), 1 / 3, np.float16)
    result = DXO(DataKind.WEIGHTS, data={PROBS: uniform}, meta={}).to_shareable()
    with pytest.raises(PayloadError, match="shape"):
        site.guard.process(result, site.context(PROBS_PHASE, task))
    fitting = DXO(DataKind.WEIGHTS, data={PROBS: uniform[:4]}, meta={}).to_shareable()
    assert site.guard.process(fitting, site.context(PROBS_PHASE, task)) is fitting
