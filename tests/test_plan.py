"""The run plan: resolved once from the layered options, and carried by the job (``app/config/medflare_plan.json``)
so that whoever reads the job (the server, each site, a reviewer) loads the very plan the command line built, for
every registered method; the FLARE components take that file and nothing else."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.workspace import Workspace
from nvflare.fuel.utils.class_utils import instantiate_class
from nvflare.fuel.utils.zip_utils import zip_directory_to_bytes
from nvflare.private.fed.utils.app_deployer import AppDeployer

from medflare import plan as plan_module
from medflare.console.cli import main
from medflare.console.deploy.apps import deployment_run
from medflare.console.job_export import write_job
from medflare.errors import ConfigError
from medflare.flare.tasks import deployed_plan
from medflare.plan import (
    APP_NAME,
    DEFAULT_TASK_TIMEOUT,
    PLAN_FILE,
    RunPlan,
    build_plan,
    plan_from_job,
    read_plan,
    resolve,
    task_of,
    validated,
)
from medflare.registry import list_methods
from medflare.run_config import RunConfig

from ._plans import write_run_job
from .test_cli import TASK, run_cli

SIMULATED = "synthetic:classes=3,channels=1"
FIELDS = [field.name for field in dataclasses.fields(RunPlan)]


def planned_and_written(run: RunConfig, out: Path, mode: str) -> tuple[RunPlan, Path]:
    run = validated(run, check_files=False)
    task = task_of(run)
    return resolve(run, mode, task=task), write_run_job(run, out, task, mode=mode)


@pytest.mark.parametrize("method", list_methods())
def test_every_method_s_job_carries_the_plan_the_command_line_built(method: str, tmp_path: Path) -> None:
    plan, job = planned_and_written(deployment_run(method), tmp_path, "preinstalled")
    assert plan_from_job(job) == plan
    assert RunPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert len(plan.rounds) == deployment_run(method).rounds and all(r.phases for r in plan.rounds)


def test_the_plan_types_its_method_and_defences_once_and_consumers_take_them_as_they_are() -> None:
    """Issue 50: a consumer takes the plan's typed objects, not a dict it must type again: the server's round core
    gets the plan's method config and defences, a site's settings the same config and its own TrainConfig. A
    plan's record replaced in place is typed again (the views never go stale)."""
    from medflare.server_round import RoundAggregation
    from medflare.site_config import SiteFile

    run = RunConfig(method="fedprox", method_args={"mu": 0.1}, robust={"max_share": 0.5}, data={"source": SIMULATED},
                    site_train={"site-2": {"lr": 0.5}})
    run = validated(run)
    plan = build_plan(run, task_of(run), {"max_share": 0.5})
    assert type(plan.method_cfg).__name__ == "FedProxConfig" and plan.method_cfg.mu == 0.1
    assert plan.defences.max_share == 0.5 and plan.method_args == dataclasses.asdict(plan.method_cfg)
    core = RoundAggregation.of_plan(plan)
    assert core.robust is plan.defences and core.rule.cfg is plan.method_cfg
    settings, _ = plan.localise("site-2", SiteFile(Path("."), None), simulated=True)
    assert settings.method_args is plan.method_cfg and settings.train is plan.site("site-2").train
    assert settings.train.lr == 0.5
    edited = dataclasses.replace(plan, robust={"max_share": 0.3}, method_args={"mu": 0.2})
    assert (edited.defences.max_share, edited.method_cfg.mu) == (0.3, 0.2)


def test_a_simulator_job_with_every_option_set_rebuilds_the_same_plan(tmp_path: Path) -> None:
    run = RunConfig(method="fedprox", rounds=4, clients=3, min_clients=2, seed=5, data={"source": SIMULATED},
                    train={"lr": 0.01, "batch_size": 8}, method_args={"mu": 0.1}, site_train={"site-2": {"lr": 0.5}},
                    site_evaluation="every_round", straggler_seconds=30, task_timeout=90, task_request_interval=0.3,
                    name="probe", robust={"max_share": 0.4}, transfer_dtype="float16", download_dtype="float16",
                    stream_aggregation=True, transfer_kind="diff",
                    dp={"filter": "percentile", "args": {"percentile": 10, "gamma": 0.01}}, audit=True,
                    tracking="both", patience=2)
    plan, job = planned_and_written(run, tmp_path, "byoc")
    assert plan_from_job(job) == plan
    assert (plan.site("site-1").train.lr, plan.site("site-2").train.lr) == (0.01, 0.5)
    assert plan.site("site-3").train.batch_size == 8 and plan.method_args["mu"] == 0.1
    assert (plan.min_clients, plan.task_timeout, plan.robust["max_share"]) == (2, 90, 0.4)
    assert plan.data["num_sites"] == 3 and plan.data["seed"] == 5


def edit_plan(job: Path, edit: Callable[[dict], None]) -> tuple[dict, dict]:
    """Apply ``edit`` to the plan in ``job``'s medflare_plan.json, as a reviewer with an editor would: (the file's
    record before, after)."""
    path = job / APP_NAME / "config" / PLAN_FILE
    before = json.loads(path.read_text())
    after = json.loads(path.read_text())
    edit(after["plan"])
    path.write_text(json.dumps(after, indent=2))
    return before, after


def test_an_edited_plan_is_what_the_job_runs_and_its_fingerprint_says_so(tmp_path: Path) -> None:
    """The job's one plan file decides: an edited value is what every reader loads, and the fingerprint it was
    written with no longer matches, which the server and the sites log."""
    plan, job = planned_and_written(RunConfig(method="fedavg", data={"source": SIMULATED}), tmp_path, "byoc")
    before, _ = edit_plan(job, lambda record: record.update(transfer_dtype="float16"))
    loaded, written = read_plan(job / APP_NAME / "config" / PLAN_FILE)
    assert loaded == dataclasses.replace(plan, transfer_dtype="float16")
    assert written == before["fingerprint"] == plan.digest() != loaded.digest()


@pytest.mark.parametrize(("edit", "refusal"), [
    (lambda plan: plan["sites"][0]["train"].update(lr="fast"), r"sites\[0\]\.train\.lr must be a finite number"),
    (lambda plan: plan["method_args"].update(mu=-1), "mu"),
    (lambda plan: plan.update(method="no-such-method"), "no-such-method"),
    (lambda plan: plan.update(min_clients=9), "min_clients must be between 1 and the plan's 2 sites"),
    (lambda plan: plan.update(extra=1), "unknown option"),
])
def test_an_edited_plan_value_that_does_not_fit_is_refused_naming_it(edit: Callable, refusal: str,
                                                                     tmp_path: Path) -> None:
    """Every reader types and checks the plan again, so an edit cannot make a site train on a value no command
    would have accepted."""
    _, job = planned_and_written(RunConfig(method="fedprox", data={"source": SIMULATED}), tmp_path, "byoc")
    edit_plan(job, edit)
    with pytest.raises(ConfigError, match=refusal):
        plan_from_job(job)


def test_the_components_take_the_plan_file_and_refuse_their_old_arguments(tmp_path: Path) -> None:
    """Each medflare component of a job is built by FLARE's own class loader from the plan file's name alone (at
    most 3 arguments, FLARE's component ids among them); a job that still passes one of the settings the plan
    holds (an edited or old job config) is refused when FLARE builds it, instead of being silently ignored."""
    _, job = planned_and_written(RunConfig(method="fedavg", data={"source": SIMULATED}, dp={
        "filter": "percentile", "args": {"percentile": 10, "gamma": 0.01}}, transfer_kind="diff"), tmp_path, "byoc")
    configs = [json.loads((job / APP_NAME / "config" / f"config_fed_{side}.json").read_text())
               for side in ("server", "client")]
    components = [c for c in _components(configs) if c["path"].startswith("medflare.") and
                  c["path"] != "medflare.flare.tracking.SiteMetricsToServer" and not c["path"].endswith("Receiver")]
    assert {c["path"].rsplit(".", 1)[1] for c in components} == {
        "MedflareModelPersistor", "MedflareAggregator", "MedflareController", "MedflareExecutor", "UpdatePrivacy"}
    for component in components:
        assert component["args"]["plan_file"] == PLAN_FILE and len(component["args"]) <= 3
        instantiate_class(component["path"], dict(component["args"]))
        for old in ({"num_rounds": 3}, {"train": {"lr": 0.9}}, {"method": "fedprox"}):
            with pytest.raises(ValueError, match="unexpected keyword argument"):
                instantiate_class(component["path"], {**component["args"], **old})


def _components(configs: list) -> list[dict]:
    """Every component a FLARE config names (executors, workflows, components and filters)."""
    found, pending = [], list(configs)
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if isinstance(value.get("path"), str):
                found.append(value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return found


def test_each_site_trains_each_stage_with_its_resolved_settings(tmp_path: Path) -> None:
    """Fed-MAE pre-trains at the stage's own lr (2e-3) and fine-tunes at the flat one (3e-3), unless a site says
    otherwise for every stage (site-2: lr 0.01); the stages run in order, pre-training unscored."""
    run = deployment_run("fed-mae", site_train={"site-2": {"lr": 0.01}})
    plan, _ = planned_and_written(run, tmp_path, "preinstalled")
    assert list(dict.fromkeys(r.stage for r in plan.rounds)) == ["pretrain", "finetune"]
    assert plan.site("site-1").train.for_stage("pretrain").lr == pytest.approx(2e-3)
    assert plan.site("site-1").train.for_stage("finetune").lr == pytest.approx(3e-3)
    assert plan.site("site-2").train.for_stage("finetune").lr == pytest.approx(0.01)
    assert plan.site("site-2").train.for_stage("pretrain").lr == pytest.approx(2e-3)  # the stage's own value wins
    assert not plan.rounds[0].scored and plan.rounds[-1].scored and plan.task_timeout == DEFAULT_TASK_TIMEOUT


def test_logit_exchange_rounds_plan_their_phases() -> None:
    run = RunConfig(method="fedmd", rounds=2, data={"source": SIMULATED, "public_fraction": 0.2})
    run = validated(run, check_files=False)
    plan = build_plan(run, task_of(run), {})
    assert [r.phases for r in plan.rounds] == [("public_setup", "public_probs", "train"), ("public_probs", "train")]


def test_medflare_config_plan_prints_the_plan_export_writes(tmp_path: Path, capsys) -> None:
    options = [*TASK, "--data", "synthetic:classes=2,channels=1", "--set", "rounds=2", "--set", "train.lr=0.02"]
    code, out, err = run_cli(["config", "fedavg", "--plan", *options], capsys)
    assert code == 0, err
    printed = RunPlan.from_dict(json.loads(out))
    assert f"plan {printed.digest()}:" in err  # the fingerprint the server and the sites log
    assert main(["export", "fedavg", *options, "-o", str(tmp_path)]) == 0
    assert plan_from_job(tmp_path / "fedavg") == printed and printed.site("site-1").train.lr == 0.02
    assert f"plan {printed.digest()}:" in capsys.readouterr().out  # export names the plan of the job it wrote


def test_a_resolved_task_is_handed_down_instead_of_read_again(tmp_path: Path, monkeypatch) -> None:
    """The runners read the data for the task once: given the task, the sites' description, the job and the
    summary's configuration never read it again."""
    from medflare.console import launch

    run = RunConfig(method="fedavg", data={"source": SIMULATED}, shot_thresholds=[30, 10])
    task = task_of(validated(run, check_files=False))

    def read_again(run: RunConfig) -> None:
        raise AssertionError("the task was read from the data again")

    monkeypatch.setattr(plan_module, "task_of", read_again)
    monkeypatch.setattr(plan_module, "_inferred_task", read_again)
    plan = plan_module.resolve(run, "byoc", task=task)
    sites, counts = plan_module.describe_sites(plan)
    job = write_job(plan, tmp_path, "byoc")
    assert set(sites) == {"site-1", "site-2"} and len(counts) == task.num_classes and plan.shot_groups
    assert plan_from_job(job).task == task
    assert launch.summary_config(plan)["task"]["num_classes"] == task.num_classes


def deployed_to(job: Path, participant: str, root: Path) -> FLContext:
    """What FLARE gives ``participant``'s components once it deployed ``job`` (its own AppDeployer: the app unzipped
    under the participant's workspace, the job's meta beside it): a context naming the workspace and the job."""
    for kit_folder in ("startup", "local"):  # a workspace as FLARE requires it
        (root / participant / kit_folder).mkdir(parents=True)
    workspace = Workspace(str(root / participant), site_name=participant)
    meta = json.loads((job / "meta.json").read_text())
    app = zip_directory_to_bytes(str(job / APP_NAME), "")  # as the server sends an app
    assert not AppDeployer().deploy(workspace, "job-1", meta, APP_NAME, app, FLContext())  # no error message
    fl_ctx = FLContext()
    fl_ctx.set_prop(ReservedKey.ENGINE, SimpleNamespace(get_workspace=lambda: workspace), private=True, sticky=False)
    fl_ctx.set_prop(ReservedKey.RUN_NUM, "job-1", private=True, sticky=False)
    return fl_ctx


@pytest.mark.parametrize("method", list_methods())
def test_the_server_and_every_site_rebuild_the_plan_the_command_line_built(method: str, tmp_path: Path) -> None:
    """From ``medflare export`` to what FLARE deploys: the plan each participant's components rebuild
    (``flare.tasks.deployed_plan``, read by the controller and the executor) equals the command line's, field by
    field, and so does its fingerprint, the one they log; a hospital with its own name rebuilds it too."""
    plan, job = planned_and_written(deployment_run(method, name=f"{method}-at-hospitals"), tmp_path / "jobs",
                                    "preinstalled")
    for participant in ("server", "site-1", "hospital-b"):
        rebuilt, loaded = deployed_plan(deployed_to(job, participant, tmp_path / "workspaces"))
        assert loaded == f"runs plan {plan.digest()} (medflare config --plan prints it)"
        assert {field: getattr(rebuilt, field) for field in FIELDS} == {field: getattr(plan, field) for field in FIELDS}
        assert rebuilt.digest() == plan.digest()


def test_a_site_data_job_hands_its_own_data_options_to_the_sites(tmp_path: Path) -> None:
    """Options a job may set at a site that reads its own images (augment, image size, the seed of its splits) reach
    the sites and the plan; before, a site-data job dropped them silently (the sites saw only {"source": "site"})."""
    run = RunConfig(method="fedavg", data={"source": "site", "augment": "none", "image_size": 32, "seed": 0},
                    task={"num_classes": 2, "in_channels": 1, "image_size": 32})
    plan, job = planned_and_written(run, tmp_path, "preinstalled")
    assert plan_from_job(job).data == {"source": "site", "augment": "none", "image_size": 32, "seed": 0} == plan.data


def calls_named(name: str) -> dict[str, list[ast.Call]]:
    """Module of the package (its path under ``custom/medflare``) -> its calls of a function or method named
    ``name`` (``name(...)`` or ``x.name(...)``; ``stats_from_dict`` is another name)."""
    package = Path(plan_module.__file__).parent
    found: dict[str, list[ast.Call]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and name in (getattr(func, "id", None), getattr(func, "attr", None)):
                found.setdefault(str(path.relative_to(package)), []).append(node)
    return found


def test_only_the_resolver_looks_a_method_up_and_types_its_options() -> None:
    """Issue 50: a method is looked up in at most 4 modules besides the registry (the plan, the catalog; 17 before),
    ``from_dict`` is called in at most 6 (15 before), and a method's options are typed only in ``plan.py``."""
    lookups = set(calls_named("get_method")) - {"registry.py"}
    typings = calls_named("from_dict")
    method_options = {module for module, calls in typings.items()
                      if any("config_cls" in ast.unparse(call.args[0]) for call in calls if call.args)}
    assert "plan.py" in lookups and len(lookups) <= 4, sorted(lookups)
    assert {"plan.py", "site_config.py"} <= set(typings) and len(typings) <= 6, sorted(typings)
    assert method_options == {"plan.py"}


@pytest.mark.parametrize("method", list_methods())
def test_the_plans_rounds_are_the_schedule_the_server_rule_builds_stage_by_stage(method: str) -> None:
    """Issue 64: the controller and the in-process engine run ``plan.round_contexts()``, which equal the method's
    stages round by round; each round's recorded phases are a fresh rule's (a stateful rule decides them as it runs:
    tests/integration/test_fedlsm_simulator.py, FedLSM's set-up phase in round 0 only)."""
    from medflare.server_setup import round_plan, server_rule

    from .integration._smoke import smoke_run

    plan = resolve(smoke_run(method), "byoc")
    rule, stages, _ = server_rule(plan.spec, plan.method_cfg, len(plan.rounds), plan.robust, plan.transfer_dtype,
                                  plan.transfer_kind, plan.download_dtype, plan.task.multi_label)
    built = round_plan(stages, len(plan.rounds))
    assert plan.round_contexts() == tuple(built)
    assert [step.phases for step in plan.rounds] == [tuple(rule.phases(ctx)) for ctx in built]


def test_round_contexts_restart_the_stage_counters_with_each_stage() -> None:
    plan = resolve(RunConfig(method="fed-mae", rounds=5, clients=2, method_args={"pretrain_rounds": 2},
                             data={"source": "synthetic:n=60,classes=2,size=16"}), "byoc")
    assert [(c.round, c.stage, c.stage_round, c.stage_rounds, c.total_rounds, c.scored)
            for c in plan.round_contexts()] == [(0, "pretrain", 0, 2, 5, False), (1, "pretrain", 1, 2, 5, False),
                                                (2, "finetune", 0, 3, 5, True), (3, "finetune", 1, 3, 5, True),
                                                (4, "finetune", 2, 3, 5, True)]


def test_the_plans_sections_are_typed_once_where_it_is_read_and_an_ill_typed_one_is_refused(tmp_path: Path) -> None:
    """Issue 64: ``data``, ``dp`` and ``dp_sgd`` are typed when the plan is built or read (``dp_filter``,
    ``dp_sgd_cfg``); every reader takes those (the sites' privacy filter, each site's DP-SGD)."""
    from medflare.dp_sgd import DPSGDConfig
    from medflare.site_config import DPFilter

    run = RunConfig(method="fedavg", data={"source": "synthetic:n=60", "imbalance": 4},
                    dp={"filter": "svt", "args": {"epsilon": 0.1}}, dp_sgd={"noise_multiplier": 1.5},
                    transfer_kind="diff")
    plan = resolve(run, "byoc")
    assert plan.data["imbalance"] == 4.0 and isinstance(plan.data["imbalance"], float)  # typed as DataConfig's
    assert plan.dp_filter == DPFilter("svt", {"epsilon": 0.1})
    assert isinstance(plan.dp_sgd_cfg, DPSGDConfig) and plan.dp_sgd_cfg.noise_multiplier == 1.5
    job = write_job(plan, tmp_path / "jobs", "byoc")
    rebuilt = plan_from_job(job)
    assert (rebuilt.dp_filter, rebuilt.dp_sgd_cfg, rebuilt.data) == (plan.dp_filter, plan.dp_sgd_cfg, plan.data)
    assert resolve(RunConfig(method="fedavg", data={"source": "synthetic:n=60"}), "byoc").dp_sgd_cfg is None
    plan_file = job / APP_NAME / "config" / PLAN_FILE
    record = json.loads(plan_file.read_text())
    record["plan"]["dp"] = {"filter": "gauss"}
    plan_file.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="UpdatePrivacy filter must be one of"):
        plan_from_job(job)
