"""Tracking that researchers can query, without FLARE's simulator: the MLflow receiver's configuration (experiment,
run name, tags, params), one MLflow run per job that ``mlflow.search_runs`` finds by method and lr (a real SQLite
store in a temporary folder), and the per-site training and validation series a site streams."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from nvflare.apis.analytix import AnalyticsDataType, LogWriterName
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import ProcessType, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import make_reply
from nvflare.apis.utils.analytix_utils import create_analytic_dxo
from nvflare.fuel.utils.json_scanner import JsonScanner
from nvflare.fuel.utils.wfconf import resolve_var_refs

from medflare import contracts
from medflare.console.job_export import server_config
from medflare.flare import executor as executor_module, tracking
from medflare.flare.tasks import TASK_TRAIN, TASK_VALIDATE, round_meta
from medflare.methods.base import RoundContext
from medflare.metrics import EvalStats, MultiLabelEvalStats, compute_metrics
from medflare.plan import resolve
from medflare.run_config import RunConfig
from medflare.site_config import TaskSpec

from .._plans import site_data_plan

TASK = TaskSpec(num_classes=3, in_channels=1, image_size=28)
JOB_ID = "3f2a9c1e-0b7d-4c55-9d0e-5a6b7c8d9e0f"


def fedprox_run(**changes: Any) -> RunConfig:
    settings = dict(method="fedprox", model="cnn", seed=3, rounds=4, tracking="mlflow", train={"lr": 0.01},
                    method_args={"mu": 0.1}, data={"source": "synthetic", "partition": "dirichlet:0.5"})
    return RunConfig(**{**settings, **changes})


def receiver_args(run: RunConfig) -> dict[str, Any]:
    components = server_config(resolve(run, task=TASK))["components"]
    return next(c["args"] for c in components if c["id"] == "mlflow_receiver")


# ----- the job's configuration ---------------------------------------------------------------------------
def test_the_mlflow_receiver_is_configured_with_the_experiment_run_name_tags_and_params(monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    args = receiver_args(fedprox_run())
    assert args["kw_args"] == {
        "experiment_name": "medflare", "run_name": "fedprox-cnn-s3", "experiment_tags": {},
        "run_tags": {"method": "fedprox", "model": "cnn"},
    }
    params = args["params"]
    assert {key: params[key] for key in ("method", "model", "rounds", "clients", "seed", "min_clients")} == {
        "method": "fedprox", "model": "cnn", "rounds": "4", "clients": "2", "seed": "3", "min_clients": "2"}
    assert params["train.lr"] == "0.01" and params["method.mu"] == "0.1"
    assert params["data.source"] == "synthetic" and params["data.partition"] == "dirichlet:0.5"
    # the task and the intensity window are params too (issue 61): runs of other tasks or windows are told apart
    assert {key: params[key] for key in params if key.startswith("task.")} == {
        "task.num_classes": "3", "task.in_channels": "1", "task.image_size": "28", "task.multi_label": "False",
        "task.class_names": "None"}
    assert params["data.window"] == "none"
    assert receiver_args(fedprox_run(data={"source": "site", "window": "40,80"}))["params"]["data.window"] == "40,80"
    # the effective settings, the method's defaults included, each named as its --set key
    assert {"train.batch_size", "train.local_epochs", "train.max_steps", "train.optimizer"} <= set(params)
    assert all(isinstance(value, str) for value in params.values())
    assert args["deployed_env"] == "poc"  # simulated data outside the simulator: only a POC's sites accept it
    assert receiver_args(fedprox_run(data={"source": "site"}))["deployed_env"] == "prod"


def test_the_experiment_is_mlflows_own_variable_where_the_job_is_written(monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "pneumonia-sweep")
    assert receiver_args(fedprox_run())["kw_args"]["experiment_name"] == "pneumonia-sweep"


def test_only_the_mlflow_receiver_takes_arguments() -> None:
    components = server_config(resolve(fedprox_run(tracking="both"), task=TASK))["components"]
    assert next(c for c in components if c["id"] == "tensorboard_receiver")["args"] == {}
    assert "mlflow_receiver" not in [c["id"] for c in server_config(resolve(fedprox_run(tracking="tensorboard"), task=TASK))
                                     ["components"]]


def test_nested_settings_become_dotted_params_that_flares_configurator_leaves_alone() -> None:
    """FLARE reads a text in braces as a variable reference; a stage's overrides must arrive as written."""
    run = RunConfig(method="fed-mae", tracking="mlflow")
    params = receiver_args(run)["params"]
    assert params["train.stages.pretrain.lr"] == str(resolve(run, task=TASK).train.stages["pretrain"]["lr"])
    assert not any(key == "train.stages" for key in params)
    config = server_config(resolve(run, task=TASK))
    resolve_var_refs(JsonScanner(config), {})  # what FLARE's job configurator does to every string
    assert next(c["args"] for c in config["components"] if c["id"] == "mlflow_receiver")["params"] == params


def test_param_values_are_short_texts() -> None:
    flat = tracking.flat_params({"a": {"b": [1, 2]}, "c": None, "d": "x" * 900, "e": {}})
    assert flat["a.b"] == "[1, 2]" and flat["c"] == "None" and "e" not in flat
    assert len(flat["d"]) == tracking.MAX_PARAM_CHARS and flat["d"].endswith("…")


# ----- one MLflow run per job, found by its params --------------------------------------------------------
class _Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root

    def get_result_root(self, job_id: str) -> str:
        return str(self.root)

    def get_run_dir(self, job_id: str) -> str:
        return str(self.root)


class _Engine:
    def __init__(self, root: Path, sites: list[str]) -> None:
        self.workspace, self.sites = _Workspace(root), sites

    def get_workspace(self) -> _Workspace:
        return self.workspace

    def get_clients(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=site) for site in self.sites]


def server_context(root: Path, job_id: str) -> FLContext:
    fl_ctx = FLContext()
    for key, value in ((ReservedKey.ENGINE, _Engine(root, ["site-1", "site-2"])), (ReservedKey.RUN_NUM, job_id),
                       (ReservedKey.PROCESS_TYPE, ProcessType.SERVER_JOB), (ReservedKey.IDENTITY_NAME, "server")):
        fl_ctx.set_prop(key, value, private=True, sticky=False)
    return fl_ctx


def scalar_event(tag: str, value: float, step: int):
    return create_analytic_dxo(tag=tag, value=value, data_type=AnalyticsDataType.SCALAR,
                               writer=LogWriterName.TORCH_TB, global_step=step).to_shareable()


@pytest.fixture
def mlflow_state(monkeypatch):
    """FLARE's receiver sets MLflow's process-wide tracking URI (and MLFLOW_TRACKING_URI); put both back after."""
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("alembic")  # MLflow's SQLite store, FLARE's default, needs it (medflare[tracking])
    monkeypatch.delenv("MEDFLARE_MLFLOW_URI", raising=False)
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield mlflow
    mlflow.set_tracking_uri(before)


def record_a_job(root: Path, run: RunConfig, job_id: str) -> None:
    """What the server's receiver does in a job: set up, record one server and one site metric, finish."""
    from medflare.flare.mlflow_receiver import MlflowReceiver

    receiver = MlflowReceiver(**receiver_args(run))
    fl_ctx = server_context(root, job_id)
    receiver.initialize(fl_ctx)
    receiver.save(fl_ctx, scalar_event("val/balanced_accuracy", 0.5, 0), "server")
    receiver.save(fl_ctx, scalar_event(tracking.ROUND_LOSS, 0.7, 1), "site-1")
    receiver.finalize(fl_ctx)


def test_one_named_run_per_job_that_search_runs_finds_by_method_and_lr(tmp_path: Path, mlflow_state) -> None:
    mlflow = mlflow_state
    record_a_job(tmp_path, fedprox_run(), JOB_ID)
    record_a_job(tmp_path, fedprox_run(train={"lr": 0.001}), "simulate_job")  # a second job, same store
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    every = mlflow.search_runs(experiment_names=["medflare"], output_format="list")
    assert len(every) == 2  # one run per job, not one per site
    found = mlflow.search_runs(experiment_names=["medflare"], output_format="list",
                               filter_string="params.method = 'fedprox' and params.`train.lr` = '0.01'")
    assert len(found) == 1
    run = found[0]
    assert run.info.run_name == "fedprox-cnn-s3-3f2a9c1e"
    assert run.data.params["seed"] == "3" and run.data.params["method.mu"] == "0.1"
    assert {key: run.data.tags[key] for key in ("method", "model", "env", "job_id")} == {
        "method": "fedprox", "model": "cnn", "env": "poc", "job_id": JOB_ID}
    assert run.data.tags["medflare_version"]
    assert run.data.metrics == {"val/balanced_accuracy": 0.5, "site-1/train/loss": 0.7}  # a site's under its name
    simulated = next(r for r in every if r.info.run_id != run.info.run_id)
    assert simulated.data.tags["env"] == "simulator" and simulated.data.params["train.lr"] == "0.001"


def test_the_server_operator_can_point_every_job_at_one_store(tmp_path: Path, mlflow_state, monkeypatch) -> None:
    mlflow = mlflow_state
    shared = tmp_path / "shared.db"
    monkeypatch.setenv("MEDFLARE_MLFLOW_URI", f"sqlite:///{shared}")
    record_a_job(tmp_path / "job", fedprox_run(), JOB_ID)
    assert shared.is_file() and not (tmp_path / "job" / "mlflow.db").exists()
    mlflow.set_tracking_uri(f"sqlite:///{shared}")
    assert len(mlflow.search_runs(experiment_names=["medflare"], output_format="list")) == 1


# ----- what a site streams --------------------------------------------------------------------------------
def validation_counts(multi_label: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    if multi_label:
        labels = rng.integers(0, 2, size=(40, 3))
        return MultiLabelEvalStats.from_predictions(labels, rng.random((40, 3)), 3, loss_sum=21.0).to_dict()
    probs = rng.dirichlet(np.ones(3), size=40)
    return EvalStats.from_predictions(rng.integers(0, 3, 40), probs, 3, loss_sum=37.0).to_dict()


@pytest.mark.parametrize("multi_label", [False, True])
def test_the_declared_validation_metrics_are_the_scalar_metrics_of_an_evaluation(multi_label: bool) -> None:
    cls = MultiLabelEvalStats if multi_label else EvalStats
    metrics = compute_metrics(cls.from_dict(validation_counts(multi_label)))
    scalars = {name for name, value in metrics.items() if not isinstance(value, list)}
    assert set(tracking.SITE_VAL_METRICS) == scalars


class _Trainer:
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.004}, {"lr": 0.01}])  # layer decay scales the first down


def site_executor(sent: list[tuple[dict[str, float], int]], monkeypatch, stream: bool = True,
                  multi_label: bool = False) -> executor_module.MedflareExecutor:
    monkeypatch.setattr(executor_module, "send_scalars", lambda component, fl_ctx, scalars, step: sent.append(
        (dict(scalars), step)))
    plan = site_data_plan("fedavg", TASK.num_classes, multi_label=multi_label, tracking="tensorboard" if stream else "off")
    return executor_module.MedflareExecutor().use_plan(plan)


def task_and_result(round_: int, meta: dict[str, Any]) -> tuple[Any, Any]:
    task = DXO(DataKind.WEIGHTS, data={}, meta=round_meta(RoundContext(round_, 5))).to_shareable()
    return task, DXO(DataKind.WEIGHTS, data={}, meta=meta).to_shareable()


@pytest.mark.parametrize("multi_label", [False, True])
def test_a_site_streams_its_validation_and_training_series_of_a_train_task(monkeypatch, multi_label: bool) -> None:
    sent: list[tuple[dict[str, float], int]] = []
    executor = site_executor(sent, monkeypatch, multi_label=multi_label)
    counts = validation_counts(multi_label)
    meta = {contracts.EVAL_VAL: counts, contracts.TRAIN_LOSS: 0.75, contracts.TRAIN_SECONDS: 2.5}
    task, result = task_and_result(2, meta)
    executor._stream_task(SimpleNamespace(trainer=_Trainer()), TASK_TRAIN, task, result, FLContext())
    (validation, val_step), (training, train_step) = sent
    expected = compute_metrics((MultiLabelEvalStats if multi_label else EvalStats).from_dict(counts))
    assert val_step == 2  # the received model: the one after 2 rounds, as the server's val/... steps
    assert validation == pytest.approx({f"val/{name}": expected[name] for name in tracking.SITE_VAL_METRICS
                                        if expected[name] is not None})
    assert train_step == 3  # the third round, as the server's train_loss/<site>
    assert training == {"train/loss": 0.75, "train/seconds": 2.5, "train/lr": 0.01}
    for tag, value in {**validation, **training}.items():  # the site's converter forwards every one of them
        assert tag in tracking.SITE_STREAMED_TAGS
        assert tracking.undeclared_stream(scalar_event(tag, value, 0)) is None


def test_a_validate_task_streams_the_final_models_validation_only(monkeypatch) -> None:
    sent: list[tuple[dict[str, float], int]] = []
    task, result = task_and_result(5, {contracts.EVAL_VAL: validation_counts()})
    site_executor(sent, monkeypatch)._stream_task(SimpleNamespace(trainer=_Trainer()), TASK_VALIDATE, task, result,
                                                  FLContext())
    assert [step for _, step in sent] == [5] and all(tag.startswith("val/") for tag in sent[0][0])


@pytest.mark.parametrize("stream,meta,result_code,expected", [
    (True, {contracts.TRAIN_LOSS: 0.5}, None, [({"train/loss": 0.5, "train/lr": 0.01}, 2)]),  # no evaluation
    (False, {contracts.TRAIN_LOSS: 0.5}, None, []),  # tracking off
    (True, {contracts.TRAIN_LOSS: 0.5}, ReturnCode.TASK_ABORTED, []),  # nothing of an aborted task
])
def test_a_site_streams_nothing_it_did_not_compute(monkeypatch, stream, meta, result_code, expected) -> None:
    sent: list[tuple[dict[str, float], int]] = []
    task, result = task_and_result(1, meta)
    if result_code is not None:
        result = make_reply(result_code)
    site_executor(sent, monkeypatch, stream=stream)._stream_task(
        SimpleNamespace(trainer=_Trainer()), TASK_TRAIN, task, result, FLContext())
    assert [(scalars, step) for scalars, step in sent if scalars] == expected


def test_the_stream_carries_what_the_sites_result_filters_let_leave_and_waits_for_them(monkeypatch) -> None:
    """A hospital filter that strips the validation counts from results strips them from the curves too: the
    executor streams on FLARE's AFTER_TASK_RESULT_FILTER event, from the filtered result, not in execute()."""
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import FLContextKey

    sent: list[tuple[dict[str, float], int]] = []
    executor = site_executor(sent, monkeypatch)
    computed = {contracts.EVAL_VAL: validation_counts(), contracts.TRAIN_LOSS: 0.75, contracts.TRAIN_SECONDS: 2.5}
    task, _ = task_and_result(2, computed)
    runtime = SimpleNamespace(trainer=_Trainer())
    executor._unstreamed_task = (runtime, TASK_TRAIN, task)  # what execute() leaves after training
    _, filtered = task_and_result(2, {contracts.TRAIN_LOSS: 0.75})  # the site's filter kept only the loss
    fl_ctx = FLContext()
    fl_ctx.set_prop(FLContextKey.TASK_RESULT, filtered, private=True, sticky=False)
    executor.handle_event(EventType.AFTER_TASK_RESULT_FILTER, fl_ctx)
    streamed = {tag for scalars, _ in sent for tag in scalars}
    assert streamed == {"train/loss", "train/lr"}  # no val/..., no train/seconds: the filter removed them
    executor.handle_event(EventType.AFTER_TASK_RESULT_FILTER, fl_ctx)  # one task, one stream
    assert len([s for s, _ in sent if s]) == 1
