"""Experiment tracking without FLARE's runtime: what the server and the sites stream, the site-side guard, the
job's components, and the receivers' stand-ins on a server without tensorboard/mlflow."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.utils.analytix_utils import create_analytic_dxo

from medflare.console.job_export import client_config, server_config
from medflare.flare import tracking
from medflare.flare.executor import MedflareExecutor
from medflare.plan import resolve
from medflare.run_config import RunConfig
from medflare.site_config import TaskSpec

REPO = Path(__file__).resolve().parents[2]
TASK = TaskSpec(num_classes=3, in_channels=1, image_size=28)


def event_data(tag: str, value: object, data_type: AnalyticsDataType = AnalyticsDataType.SCALAR):
    return create_analytic_dxo(tag=tag, value=value, data_type=data_type, global_step=0).to_shareable()


def test_round_scalars_cover_pooled_site_mean_per_site_and_declared_evaluations() -> None:
    evaluation = {
        "val": {"balanced_accuracy": 0.5, "per_class_recall": [0.1, 0.9], "auc_macro_ovr": None},
        "test": {"accuracy": 0.75, "loss": 1.25},
        "site_mean": {"accuracy": 0.7},
        "by_site": {"site-1": {"accuracy": 0.6}, "site-2": {"accuracy": 0.8}},
        "extra": {"specialization": {"test": {"accuracy": 0.9}}},
    }
    assert tracking.round_scalars(evaluation) == {
        "val/balanced_accuracy": 0.5, "test/accuracy": 0.75, "test/loss": 1.25, "site_mean/accuracy": 0.7,
        "site-1/test/accuracy": 0.6, "site-2/test/accuracy": 0.8, "specialization/test/accuracy": 0.9,
    }  # lists and undefined (None) metrics are not scalars


def test_record_scalars_are_the_rounds_own_facts() -> None:
    record = {"wall_seconds": 2.5, "share": {"site-1": 0.25, "site-2": 0.75},
              "sites": {"site-1": {"train_loss": 0.5}, "site-2": {"train_loss": float("nan")}}}
    assert tracking.record_scalars(record) == {
        "round/wall_seconds": 2.5, "share/site-1": 0.25, "share/site-2": 0.75, "train_loss/site-1": 0.5,
    }


SCALARS = AnalyticsDataType.SCALARS


@pytest.mark.parametrize("tag,value,data_type,refused", [
    (tracking.EPOCH_LOSS, 0.7, None, None),
    (tracking.EPOCH_LOSS, math.nan, None, "finite"),
    (tracking.EPOCH_LOSS, {"class_0": 3.0, "class_1": 5.0}, SCALARS, "finite number"),
    ("test/balanced_accuracy", 0.9, None, "not among the declared site metrics"),
    ("train/labels_seen", {"class_0": 3.0}, SCALARS, "not among the declared site metrics"),
])
def test_a_site_streams_only_declared_finite_scalars(tag: str, value: object, data_type, refused: str | None) -> None:
    reason = tracking.undeclared_stream(event_data(tag, value, data_type or AnalyticsDataType.SCALAR))
    assert (reason is None) if refused is None else (refused in reason)


def test_the_site_converter_forwards_declared_events_and_keeps_the_rest(monkeypatch) -> None:
    widget = tracking.SiteMetricsToServer()
    forwarded: list[str] = []
    monkeypatch.setattr(widget, "fire_fed_event", lambda event, data, fl_ctx: forwarded.append(event))
    for tag in (tracking.EPOCH_LOSS, "test/accuracy"):
        fl_ctx = FLContext()
        fl_ctx.set_prop(FLContextKey.EVENT_DATA, event_data(tag, 0.5), private=True, sticky=False)
        widget.handle_event(ANALYTIC_EVENT_TYPE, fl_ctx)
    assert forwarded == [f"fed.{ANALYTIC_EVENT_TYPE}"]  # the undeclared tag stayed at the site


@pytest.mark.parametrize("choice,receivers", [
    ("tensorboard", ["medflare.flare.tb_receiver.TensorBoardReceiver"]),
    ("mlflow", ["medflare.flare.mlflow_receiver.MlflowReceiver"]),
    ("both", ["medflare.flare.tb_receiver.TensorBoardReceiver", "medflare.flare.mlflow_receiver.MlflowReceiver"]),
    ("off", []),
])
def test_job_names_receivers_and_site_converter_under_the_allow_listed_namespace(choice: str, receivers: list) -> None:
    run = RunConfig(tracking=choice)
    server, client = server_config(resolve(run, task=TASK)), client_config(resolve(run, task=TASK))
    named = [c["path"] for c in server["components"] if "receiver" in c["id"]]
    assert named == receivers
    converters = [c["path"] for c in client["components"]]
    assert converters == (["medflare.flare.tracking.SiteMetricsToServer"] if receivers else [])
    assert MedflareExecutor().use_plan(resolve(run, task=TASK)).stream_metrics is bool(receivers)
    for path in named + converters:  # pre-installed sites allow-list medflare.flare. only
        assert path.startswith("medflare.flare.")


def test_tracking_choice_is_checked_in_one_line() -> None:
    from medflare.errors import ConfigError
    from medflare.run_config import apply_overrides

    with pytest.raises(ConfigError, match="tracking must be one of 'tensorboard', 'mlflow', 'both', 'off'"):
        apply_overrides(RunConfig(), ["tracking=wandb"])


def test_missing_notice_names_the_package_and_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    notice = tracking.missing_notice("both")
    assert notice is not None and "mlflow not installed" in notice and "medflare[tracking]" in notice
    assert "\n" not in notice and "tensorboard" not in notice.split(";")[0].replace("mlflow", "")
    assert tracking.missing_notice("off") is None


def test_receiver_stand_in_loads_with_the_same_arguments_and_records_nothing() -> None:
    stand_in = tracking.receiver_base("no_such_package.receiver", "Receiver", "no_such_package")
    assert issubclass(stand_in, tracking.MissingTrackerReceiver)
    receiver = stand_in(tb_folder="tb_events", events=None)
    assert receiver.package == "no_such_package" and receiver.options == {"tb_folder": "tb_events"}
    receiver.save(FLContext(), event_data(tracking.EPOCH_LOSS, 1.0), "site-1")  # a no-op, never an error


@pytest.mark.parametrize("module,cls,package", [
    ("medflare.flare.tb_receiver", "TensorBoardReceiver", "tensorboard"),
    ("medflare.flare.mlflow_receiver", "MlflowReceiver", "mlflow"),
])
def test_receivers_are_flares_own_with_the_package_and_stand_ins_without(module: str, cls: str, package: str) -> None:
    """In a fresh interpreter: with the package the class subclasses FLARE's receiver; with the package blocked
    (as on a server without it) the job's class still imports and builds, as a stand-in."""
    probe = (f"import sys\n{{block}}import {module} as m\nr = m.{cls}()\n"
             f"print(type(r).__mro__[1].__module__, getattr(r, 'package', ''))\n")
    env_path = f"{REPO / 'custom'}"
    results = {}
    for blocked in (False, True):
        code = probe.format(block=f"sys.modules[{package!r}] = None\n" if blocked else "")
        python_path = ":".join(filter(None, [env_path, *sys.path[1:]]))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env={"PYTHONPATH": python_path, "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr[-2000:]
        results[blocked] = out.stdout.split()
    assert results[False][0].startswith("nvflare.app_opt.tracking.")
    assert results[True] == ["medflare.flare.tracking", package]


def test_keep_server_records_copies_tensorboard_and_mlflow_records(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "server" / "simulate_job", tmp_path / "out"
    (run_dir / "tb_events" / "site-1").mkdir(parents=True)
    (run_dir / "tb_events" / "site-1" / "events.out.tfevents.1").write_bytes(b"x")
    (run_dir / "mlflow.db").write_bytes(b"db")
    out.mkdir()
    kept = tracking.keep_server_records(run_dir, out)
    assert sorted(p.name for p in kept) == ["mlflow.db", "tb_events"]
    assert (out / "tb_events" / "site-1" / "events.out.tfevents.1").read_bytes() == b"x"
