"""Issue 60, item 3: one schema of bounds (``medflare.config.Bound``, in each config field's metadata), applied alike
by the command line (``plan.resolve``) and by ``read_plan`` at the server and every site. An out-of-range value is
one line naming the field, the value and the range, before anything is launched or trained."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import types
from pathlib import Path
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from medflare.config import BOUND
from medflare.console.cli import main
from medflare.data import DataConfig
from medflare.dp_sgd import DPSGDConfig
from medflare.errors import ConfigError
from medflare.methods.base import TrainConfig
from medflare.ops import wire
from medflare.plan import APP_NAME, PLAN_FILE, RoundPlan, RunPlan, SitePlan, plan_from_job, read_plan
from medflare.run_config import RunConfig, WireDtype, WireKind
from medflare.server_setup import RobustConfig
from medflare.site_config import TaskSpec

from ._plans import app_context

# Every config dataclass a job's options or its plan are typed with
SCHEMA_CLASSES = (RunConfig, RunPlan, SitePlan, RoundPlan, TaskSpec, TrainConfig, RobustConfig, DPSGDConfig,
                  DataConfig)
TASK = ["--set", "task.num_classes=2", "--set", "task.in_channels=1", "--set", "task.image_size=28"]


def set_train(key: str, value: Any) -> Callable[[dict], None]:
    """An edit of the plan's job-wide and first site's training settings (a site may read either)."""
    def edit(plan: dict) -> None:
        plan["train"][key] = value
        plan["sites"][0]["train"][key] = value
    return edit


def set_top(key: str, value: Any) -> Callable[[dict], None]:
    return lambda plan: plan.update({key: value})


def set_in(section: str, key: str, value: Any) -> Callable[[dict], None]:
    return lambda plan: plan[section].update({key: value})


def many_rounds(count: int) -> Callable[[dict], None]:
    """The plan's rounds list grown to ``count`` rounds, numbered in order (as a hand edit would)."""
    def edit(plan: dict) -> None:
        last = plan["rounds"][-1]
        plan["rounds"] = [{**last, "round": index} for index in range(count)]
    return edit


# (the field as the message names it, the value shown, an edit of the plan record, the --set that gives the same
# value on the command line or None where the plan's field has no option of its own)
OUT_OF_RANGE = [
    ("straggler_seconds", "-1", set_top("straggler_seconds", -1), "straggler_seconds=-1"),
    ("task_timeout", "1000000000", set_top("task_timeout", 10**9), "task_timeout=1000000000"),
    ("task_request_interval", "0", set_top("task_request_interval", 0), "task_request_interval=0"),
    ("task_request_interval", "1000000000.0", set_top("task_request_interval", 1e9), "task_request_interval=1e9"),
    ("patience", "-1", set_top("patience", -1), "patience=-1"),
    ("seed", "-1", set_top("seed", -1), "seed=-1"),
    ("rounds", "100001", many_rounds(100_001), "rounds=100001"),
    ("train.num_workers", "-1", set_train("num_workers", -1), "train.num_workers=-1"),
    ("train.num_workers", "1000000", set_train("num_workers", 10**6), "train.num_workers=1000000"),
    ("train.torch_threads", "0", set_train("torch_threads", 0), "train.torch_threads=0"),
    ("train.torch_threads", "1000000", set_train("torch_threads", 10**6), "train.torch_threads=1000000"),
    ("train.local_epochs", "1000000000", set_train("local_epochs", 10**9), "train.local_epochs=1000000000"),
    ("train.batch_size", "10000000", set_train("batch_size", 10**7), "train.batch_size=10000000"),
    ("train.momentum", "-0.5", set_train("momentum", -0.5), "train.momentum=-0.5"),
    ("train.momentum", "1.0", set_train("momentum", 1.0), "train.momentum=1.0"),
    ("train.weight_decay", "-1.0", set_train("weight_decay", -1.0), "train.weight_decay=-1"),
    ("train.grad_clip", "-1.0", set_train("grad_clip", -1.0), "train.grad_clip=-1"),
    ("train.eval_batch_size", "0", set_train("eval_batch_size", 0), "train.eval_batch_size=0"),
    ("train.betas", "[0.9, 1.5]", set_train("betas", [0.9, 1.5]), "train.betas=[0.9,1.5]"),
    ("task.image_size", "100000", set_in("task", "image_size", 100_000), "task.image_size=100000"),
    ("data.label_noise", "5.0", set_in("data", "label_noise", 5.0), "data.label_noise=5"),
    ("data.site_shift", "1000000.0", set_in("data", "site_shift", 1e6), "data.site_shift=1e6"),
    ("dp_sgd.delta", "2.0", set_top("dp_sgd", {"delta": 2.0}), "dp_sgd.delta=2"),
    ("robust.max_share", "2.0", set_in("robust", "max_share", 2.0), "robust.max_share=2"),
    ("tracking", "'nonsense'", set_top("tracking", "nonsense"), "tracking=nonsense"),
    ("evaluation", "'sometimes'", set_top("evaluation", "sometimes"), None),
    ("secure_aggregation", "'rot13'", set_top("secure_aggregation", "rot13"), "secure_aggregation=rot13"),
    ("transfer_dtype", "'float64'", set_top("transfer_dtype", "float64"), "transfer_dtype=float64"),
    ("job_name", "'../escape'", set_top("job_name", "../escape"), None),
    ("min_clients", "0", set_top("min_clients", 0), None),
]
IDS = [f"{field}={shown}" for field, shown, _, _ in OUT_OF_RANGE]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """One exported job (site data, declared task), as ``medflare export`` writes it."""
    out = tmp_path_factory.mktemp("exported")
    assert main(["export", "fedavg", *TASK, "--data", "site", "-o", str(out)]) == 0
    return out / "fedavg"


def edited_job(job: Path, edit: Callable[[dict], None], folder: Path) -> Path:
    """A copy of ``job``'s plan file in ``folder/app/config`` with ``edit`` applied to its plan record."""
    config = folder / APP_NAME / "config"
    config.mkdir(parents=True)
    record = json.loads((job / APP_NAME / "config" / PLAN_FILE).read_text())
    edit(record["plan"])
    (config / PLAN_FILE).write_text(json.dumps(record))
    return folder


def assert_one_line(message: str, field: str, shown: str) -> None:
    assert "\n" not in message and len(message) < 400, message
    assert f"{field} must be" in message and f"got {shown}" in message, message


@pytest.mark.parametrize(("field", "shown", "edit", "option"), OUT_OF_RANGE, ids=IDS)
def test_read_plan_refuses_an_edited_value_out_of_range_in_one_line(field: str, shown: str, edit: Callable,
                                                                    option: str | None, exported: Path,
                                                                    tmp_path: Path) -> None:
    """An edited ``medflare_plan.json`` is held to the bounds the command line applies: the server and every site
    read it with ``read_plan`` (``flare.tasks.deployed_plan``), which refuses it naming the field, value and range."""
    job = edited_job(exported, edit, tmp_path)
    with pytest.raises(ConfigError) as refused:
        read_plan(job / APP_NAME / "config" / PLAN_FILE)
    message = str(refused.value)
    assert_one_line(message, field, shown)
    assert "must be between" in message or "must be one of" in message or "must be >" in message \
        or "at most" in message or "plain job name" in message, message


def test_a_plan_of_more_rounds_than_a_run_may_have_is_refused_by_its_length(exported: Path, tmp_path: Path) -> None:
    """100,001 rounds (``rounds`` <= 100,000 on the command line) are refused by the count, in one line."""
    job = edited_job(exported, many_rounds(100_001), tmp_path)
    with pytest.raises(ConfigError, match=r"^medflare_plan.json.rounds must be a list of at most 100000 entries, got 100001$"):
        read_plan(job / APP_NAME / "config" / PLAN_FILE)


def test_the_participants_refuse_an_edited_plan_where_they_load_it(exported: Path, tmp_path: Path) -> None:
    """The server's components and a site's executor load the plan through ``deployed_plan``: a plan edited to a
    ``tracking`` value no receiver knows (a KeyError at the site before) is refused there, in one line."""
    from medflare.flare.tasks import deployed_plan
    job = edited_job(exported, set_top("tracking", "nonsense"), tmp_path)
    with pytest.raises(ConfigError, match="tracking must be one of 'tensorboard', 'mlflow', 'both', 'off', got "
                                          "'nonsense'"):
        deployed_plan(app_context(job / APP_NAME))


@pytest.fixture
def nothing_starts(monkeypatch) -> None:
    """Any child process started fails the test: the bounds are checked before launching."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize(("field", "shown", "edit", "option"),
                         [case for case in OUT_OF_RANGE if case[3]], ids=[i for i, c in zip(IDS, OUT_OF_RANGE) if c[3]])
@pytest.mark.parametrize("command", ["export", "run"])
def test_the_command_line_refuses_the_same_value_before_launch(command: str, field: str, shown: str, edit: Callable,
                                                               option: str, tmp_path: Path, capsys,
                                                               nothing_starts) -> None:
    """``--set`` of the same out-of-range value is refused by ``plan.resolve`` before anything is written or
    started (``--set train.num_workers=-1`` failed only after launch), in one line naming the field."""
    out = tmp_path / "out"
    args = (["export", "fedavg", *TASK, "-o", str(out)] if command == "export"
            else ["run", "fedavg", "--out", str(out)])
    try:
        code = main([*args, "--set", option])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert field.rpartition(".")[2] in err and " must be " in err, err
    assert not out.exists()


def test_an_unedited_exported_plan_reads_back(exported: Path) -> None:
    """The bounds leave a plan medflare wrote as it was (what the shipped job templates also check)."""
    assert plan_from_job(exported).tracking == "tensorboard"


# ----- the schema covers every field ---------------------------------------------------------------------------
def kinds(hint: Any) -> set[str]:
    """What a field's annotation holds, at any depth: "int", "float", "str", "literal" (an enumeration),
    "section" (a nested config dataclass or a free-form dict typed by its own config class)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return {"literal"}
    if origin in (Union, types.UnionType, list, tuple, dict):
        if origin is dict and args and args[1] is Any:
            return {"section"}
        return set().union(*(kinds(arg) for arg in args if arg not in (type(None), Ellipsis)))
    if dataclasses.is_dataclass(hint):
        return {"section"}
    if hint is bool:
        return set()
    return {name for name, type_ in (("int", int), ("float", float), ("str", str)) if hint is type_}


def unbounded(cls: type) -> list[str]:
    """The numeric and text fields of ``cls`` whose schema says nothing of their range or form."""
    hints = get_type_hints(cls)
    missing = []
    for field in dataclasses.fields(cls):
        found, bound = kinds(hints[field.name]), field.metadata.get(BOUND)
        if found <= {"section", "literal"}:
            continue
        if bound is None:
            missing.append(f"{cls.__name__}.{field.name}: no Bound")
        elif "int" in found and not bound.checked_by and (bound.low is None or bound.high is None):
            missing.append(f"{cls.__name__}.{field.name}: a whole number needs both ends")
        elif found & {"int", "float"} and bound.low is None and bound.high is None and not bound.checked_by:
            missing.append(f"{cls.__name__}.{field.name}: a number needs a range")
        elif "str" in found and not (bound.choices or bound.pattern or bound.checked_by):
            missing.append(f"{cls.__name__}.{field.name}: text needs choices, a pattern or the check that holds it")
    return missing


@pytest.mark.parametrize("cls", SCHEMA_CLASSES, ids=[cls.__name__ for cls in SCHEMA_CLASSES])
def test_every_number_and_text_of_the_plan_and_the_run_has_a_bound(cls: type) -> None:
    """A new field cannot escape the schema: every int, float or str field of a config dataclass declares a Bound
    (both ends for whole numbers) or is an enumeration (Literal)."""
    assert unbounded(cls) == []


def test_the_plan_declares_the_run_options_bounds_not_its_own() -> None:
    """The plan's copy of a run option carries the run option's Bound (``same_bound``), so the two never differ."""
    runs = {f.name: f.metadata.get(BOUND) for f in dataclasses.fields(RunConfig)}
    plans = {f.name: f.metadata.get(BOUND) for f in dataclasses.fields(RunPlan)}
    for name in ("seed", "patience", "straggler_seconds", "task_timeout", "task_request_interval", "resume_from"):
        assert plans[name] == runs[name] is not None
    assert plans["evaluation"] == runs["site_evaluation"]


def test_the_wire_enumerations_are_the_wire_modules() -> None:
    """The run's transfer options enumerate what :mod:`medflare.ops.wire` sends (kept apart: ops imports torch)."""
    assert get_args(WireDtype) == wire.DTYPES and get_args(WireKind) == wire.KINDS
