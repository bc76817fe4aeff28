"""The site's executor starts from the job's plan (``app/config/medflare_plan.json`` as FLARE deployed it) and from
the hospital's own ``local/medflare_site.json``, read once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvflare.apis.fl_constant import ReservedKey

from medflare import readback
from medflare.errors import DataError
from medflare.flare.executor import MedflareExecutor
from medflare.methods.base import RoundContext
from medflare.plan import APP_NAME, PLAN_FILE, resolve, task_of, validated
from medflare.run_config import RunConfig
from medflare.site_config import SITE_CONFIG_FILE, SiteFile
from medflare.site_policy import AUDIT_GENESIS, verify_audit

from .._plans import write_run_job
from ..test_plan import deployed_to

SITE_DATA = {"source": "synthetic:n=60,classes=2,channels=1,size=28", "augment": "none"}

TASK = {"num_classes": 2, "in_channels": 1, "image_size": 28, "class_names": ["class_0", "class_1"]}


def test_a_site_trains_what_the_plan_says_with_the_data_and_model_its_own_file_names(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    run = RunConfig(method="fedavg", clients=2, data={"source": "site"}, train={"lr": 0.02, "batch_size": 8},
                    site_train={"site-2": {"lr": 0.5}}, task=TASK)
    run = validated(run, check_files=False)
    plan = resolve(run, "preinstalled")
    job = write_run_job(run, tmp_path / "jobs", task_of(run), mode="preinstalled")
    fl_ctx = deployed_to(job, "site-2", tmp_path / "workspaces")
    site_file = tmp_path / "workspaces" / "site-2" / "local" / SITE_CONFIG_FILE
    site_file.write_text(json.dumps({"data": SITE_DATA}))
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-2", private=True, sticky=False)
    reads = []
    load_json = readback.load_json
    monkeypatch.setattr(readback, "load_json", lambda path, *args, **kw: reads.append(path) or load_json(path, *args, **kw))

    runtime = MedflareExecutor()._get_runtime(fl_ctx)
    try:
        # one parse serves data, model, DP-SGD and processes
        assert [Path(p) for p in reads if Path(p).name == SITE_CONFIG_FILE] == [site_file]
        assert runtime.train_cfg == plan.site("site-2").train and runtime.train_cfg.lr == 0.5
        assert runtime.settings.data == {**SITE_DATA, "local": True, "num_sites": 1}
        assert (runtime.settings.model, runtime.method_cfg) == (plan.model, plan.method_cfg)
    finally:
        runtime.close()


def test_a_site_trains_with_a_value_edited_in_the_jobs_plan_file(tmp_path: Path) -> None:
    """Issue 50: one training option edited in the job's medflare_plan.json, and nothing else, is what the site's
    optimizer steps with (the plan is the only place the site reads it from)."""
    run = RunConfig(method="fedavg", clients=2, data={"source": "site"}, train={"lr": 0.02, "max_steps": 1,
                    "batch_size": 8}, task=TASK)
    run = validated(run, check_files=False)
    job = write_run_job(run, tmp_path / "jobs", task_of(run), mode="preinstalled")
    plan_file = job / APP_NAME / "config" / PLAN_FILE
    record = json.loads(plan_file.read_text())
    assert record["plan"]["sites"][1]["name"] == "site-2" and record["plan"]["sites"][1]["train"]["lr"] == 0.02
    record["plan"]["sites"][1]["train"]["lr"] = 0.0123
    plan_file.write_text(json.dumps(record))
    fl_ctx = deployed_to(job, "site-2", tmp_path / "workspaces")
    (tmp_path / "workspaces" / "site-2" / "local" / SITE_CONFIG_FILE).write_text(json.dumps({"data": SITE_DATA}))
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-2", private=True, sticky=False)
    runtime = MedflareExecutor()._get_runtime(fl_ctx)
    try:
        runtime.train(runtime.shared_weights(), RoundContext(0, len(record["plan"]["rounds"])))
        assert [group["lr"] for group in runtime.trainer.optimizer.param_groups] == [0.0123] * len(
            runtime.trainer.optimizer.param_groups)
    finally:
        runtime.close()


def test_a_site_without_its_data_file_says_so_before_anything_trains(tmp_path: Path) -> None:
    run = RunConfig(method="fedavg", data={"source": "site"}, task=TASK)
    run = validated(run, check_files=False)
    job = write_run_job(run, tmp_path / "jobs", task_of(run), mode="preinstalled")
    fl_ctx = deployed_to(job, "site-1", tmp_path / "workspaces")
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=True, sticky=False)
    with pytest.raises(DataError, match="this site has no data configured"):
        MedflareExecutor()._get_runtime(fl_ctx)


# ----- the hospital's policy and its audit log (issue 48, item 5) -------------------------------------------------
def site_executor(tmp_path: Path, site_content: dict, **run_options) -> tuple[MedflareExecutor, object, Path]:
    """The executor of a pre-installed job (fedavg unless ``run_options`` say otherwise) deployed to site-1, whose
    ``local/medflare_site.json`` holds ``site_content``; with its FLContext and that file's folder."""
    run = RunConfig(**{"method": "fedavg", "data": {"source": "site"}, "task": TASK, **run_options})
    run = validated(run, check_files=False)
    job = write_run_job(run, tmp_path / "jobs", task_of(run), mode="preinstalled")
    fl_ctx = deployed_to(job, "site-1", tmp_path / "workspaces")
    local = tmp_path / "workspaces" / "site-1" / "local"
    (local / SITE_CONFIG_FILE).write_text(json.dumps(site_content))
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=True, sticky=False)
    return MedflareExecutor(), fl_ctx, local


def audit_lines(local: Path) -> list[dict]:
    return [json.loads(line) for line in (local / "medflare_audit.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("policy, run_options, reason", [
    ({"methods": ["fedprox", "fedmas"]}, {}, "method 'fedavg' is not among the methods this site accepts"),
    ({"require": ["dp_sgd"]}, {}, "the job has no dp_sgd, which this site requires"),
    ({"require": ["robust", "secure_aggregation"]}, {"robust": {"off": True}},
     "the job has no robust, secure_aggregation, which this site requires"),
])
def test_a_job_the_sites_policy_refuses_is_declined_before_any_image_is_read_and_audited(
    tmp_path: Path, monkeypatch, policy: dict, run_options: dict, reason: str
) -> None:
    from medflare.errors import SiteDeclined

    executor, fl_ctx, local = site_executor(tmp_path, {"data": SITE_DATA, "policy": policy}, **run_options)
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: pytest.fail("the site read its data"))
    for _ in range(2):  # every task of the job gets the same answer; the audit log gets one line
        with pytest.raises(SiteDeclined, match=f"^site-1 declines the job: {reason}"):
            executor._get_runtime(fl_ctx)
    [line] = audit_lines(local)
    assert (line["event"], line["decision"], line["method"], line["job_id"]) == ("decision", "declined", "fedavg",
                                                                                 "job-1")
    assert line["reason"].startswith(reason) and len(line["plan"]) == 12 and line["prev"] == AUDIT_GENESIS


def test_a_misspelt_key_of_the_site_file_refuses_the_job_before_any_image_is_read(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """Issue 61, item 5: ``polcy`` beside ``data`` was ignored, so the site trained with no policy at all."""
    from medflare.errors import DataError

    executor, fl_ctx, _ = site_executor(tmp_path, {"data": SITE_DATA, "polcy": {"require": ["dp_sgd"]}})
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: pytest.fail("the site read its data"))
    with pytest.raises(DataError, match=r"unknown key 'polcy' \(did you mean 'policy'\?\), which medflare would "
                                        r"ignore; a site file has allow_job_data, data, distributed, dp_sgd, model, "
                                        r"policy and _comment\.\.\. notes"):
        executor._get_runtime(fl_ctx)


@pytest.mark.parametrize("site_file, refusal", [
    ({"data": SITE_DATA, "policy": {"requir": ["dp_sgd"]}},
     r"medflare_site.json policy: unknown option\(s\) requir \(did you mean 'require'\?\); valid options: "),
    ({"data": {**SITE_DATA, "augmnt": "none"}},
     r"medflare_site.json data: unknown option\(s\) augmnt \(did you mean 'augment'\?\); valid options: "),
])
def test_a_misspelt_key_inside_a_section_of_the_site_file_refuses_the_job_before_any_image_is_read(
    tmp_path: Path, monkeypatch, site_file: dict, refusal: str
) -> None:
    """Issue 61 minors: a typo one level down (``policy.requir``) is refused as the top-level one is."""
    from medflare.errors import MedflareError

    executor, fl_ctx, _ = site_executor(tmp_path, site_file)
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: pytest.fail("the site read its data"))
    with pytest.raises(MedflareError, match=refusal):
        executor._get_runtime(fl_ctx)


def test_comment_keys_inside_the_site_files_sections_are_notes(tmp_path: Path) -> None:
    site_dir = tmp_path / "local"
    site_dir.mkdir()
    (site_dir / SITE_CONFIG_FILE).write_text(json.dumps({
        "data": {**SITE_DATA, "_comment": "where the images are", "class_map": {"_comment": "none", "a": "b"}},
        "policy": {"_comment_who": "any method"}}))
    assert SiteFile.of(site_dir).content == {"data": {**SITE_DATA, "class_map": {"a": "b"}}, "policy": {}}


def finish_task(executor: MedflareExecutor, fl_ctx, runtime, round_index: int, meta: dict) -> None:
    """One train task of ``round_index`` whose (filtered) result left the site with one array and ``meta``."""
    import numpy as np
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import FLContextKey

    task = DXO(DataKind.WEIGHTS, data={}, meta={"round": round_index}).to_shareable()
    result = DXO(DataKind.WEIGHTS, data={"w": np.zeros(4, np.float32)}, meta=meta).to_shareable()
    executor._unstreamed_task = (runtime, "train", task)
    fl_ctx.set_prop(FLContextKey.TASK_RESULT, result, private=True, sticky=False)
    executor.handle_event(EventType.AFTER_TASK_RESULT_FILTER, fl_ctx)


def test_an_accepted_job_leaves_a_chained_line_per_step_with_what_left_the_site(tmp_path: Path) -> None:
    from nvflare.apis.event_type import EventType

    policy = {"methods": ["fedavg"], "require": ["robust"]}  # a pre-installed job has the deployment defences
    executor, fl_ctx, local = site_executor(tmp_path, {"data": SITE_DATA, "policy": policy})
    runtime = executor._get_runtime(fl_ctx)
    try:
        finish_task(executor, fl_ctx, runtime, 3, {"n_samples": 60})
        executor.handle_event(EventType.END_RUN, fl_ctx)
    finally:
        runtime.close()
    accepted, task, end = audit_lines(local)
    assert (accepted["event"], accepted["decision"]) == ("decision", "accepted") and "reason" not in accepted
    assert {k: task[k] for k in ("event", "task", "round", "meta_keys", "arrays", "array_count", "bytes")} == {
        "event": "task", "task": "train", "round": 3, "meta_keys": ["n_samples"], "arrays": {"w": 16},
        "array_count": 1, "bytes": 16}
    assert {k: end[k] for k in ("event", "tasks", "failed", "bytes")} == {"event": "end", "tasks": 1, "failed": 0,
                                                                          "bytes": 16}
    assert verify_audit((local / "medflare_audit.jsonl").read_bytes()).broken is None


def test_a_job_killed_mid_run_leaves_its_accept_and_task_lines_with_the_epsilon_spent(tmp_path: Path) -> None:
    """Issue 60: the log was written only at END_RUN, so a killed job left no line. Here the job never ends (no
    END_RUN, the executor is dropped as a SIGKILL drops it) and the file holds what happened up to then."""
    from medflare import contracts

    executor, fl_ctx, local = site_executor(tmp_path, {"data": SITE_DATA}, tracking="off")  # no curves to stream
    runtime = executor._get_runtime(fl_ctx)
    try:
        assert [line["decision"] for line in audit_lines(local)] == ["accepted"]  # before any image is read
        for round_index, spent in enumerate((0.4, 0.9)):
            finish_task(executor, fl_ctx, runtime, round_index, {"n_samples": 60, contracts.DP_EPSILON: spent})
    finally:
        runtime.close()
    del executor
    lines = audit_lines(local)
    assert [line["event"] for line in lines] == ["decision", "task", "task"]
    assert [line[contracts.DP_EPSILON] for line in lines[1:]] == [0.4, 0.9]
    assert [line["round"] for line in lines[1:]] == [0, 1]
    assert verify_audit((local / "medflare_audit.jsonl").read_bytes()).broken is None


@pytest.mark.parametrize("audit_log", ["../medflare_audit.jsonl", "ESCAPE"])
def test_an_audit_log_outside_local_is_refused_before_the_job_runs(tmp_path: Path, monkeypatch,
                                                                   audit_log: str) -> None:
    """Issue 60: ``policy.audit_log`` led anywhere, e.g. into another site's folder or through a symlink."""
    from medflare.errors import ConfigError

    outside = tmp_path / "workspaces" / "site-1" / "outside"
    outside.mkdir(parents=True)
    executor, fl_ctx, local = site_executor(tmp_path, {"data": SITE_DATA, "policy": {"audit_log": audit_log}})
    if audit_log == "ESCAPE":  # a link inside local/ to a folder outside it
        (local / "ESCAPE").symlink_to(outside / "audit.jsonl")
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: pytest.fail("the site read its data"))
    with pytest.raises(ConfigError, match=f"^policy.audit_log '{audit_log}' is not a file inside the site's"):
        executor._get_runtime(fl_ctx)
    assert not list(outside.iterdir()) and not (local.parent / "medflare_audit.jsonl").exists()


def test_the_policys_class_floor_reaches_the_statistics_the_site_sends(tmp_path: Path) -> None:
    from medflare import contracts
    from medflare.errors import ConfigError
    from medflare.site_policy import site_policy

    executor, fl_ctx, _ = site_executor(tmp_path, {"data": SITE_DATA, "policy": {"min_class_samples": 1000}})
    runtime = executor._get_runtime(fl_ctx)
    try:
        labels = runtime.trainer.predictions("test")[0]
        assert runtime.settings.min_class_samples == 1000 and 0 < len(labels) < 1000
        assert runtime._evaluation_meta()[contracts.EVAL_TEST]["count"] == 0  # every class is under the floor
        runtime.trainer.min_class_samples = 0
        assert runtime._evaluation_meta()[contracts.EVAL_TEST]["count"] == len(labels)
    finally:
        runtime.close()
    with pytest.raises(ConfigError, match="min_class_samples must be a count"):
        site_policy(SiteFile(tmp_path / "medflare_site.json", {"policy": {"min_class_samples": -1}}))


def test_a_task_its_own_filter_refused_is_declined_with_the_cause(tmp_path: Path, monkeypatch) -> None:
    """Issue 49, item 4: e.g. he.DecryptTask found the decrypted model implausible; the site does not train."""
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.signal import Signal

    from medflare import contracts

    executor, fl_ctx, _ = site_executor(tmp_path, {"data": SITE_DATA})
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: pytest.fail("the site trained"))
    logged: list[str] = []
    monkeypatch.setattr(executor, "log_error", lambda fl_ctx, message: logged.append(message))
    task = DXO(DataKind.WEIGHTS, data={}, meta={}).to_shareable()
    task.set_header(contracts.REFUSED_TASK_HEADER, "the decrypted global model is implausible: 'w' is not finite")
    reply = executor.execute("train", task, fl_ctx, Signal())
    # only a word of the closed vocabulary leaves the site; the details stay in its log
    assert reply.get_header(contracts.DECLINED_HEADER) == "implausible_model"
    assert logged == ["site-1: task 'train' declined: site-1 refuses the task: the decrypted global model is "
                      "implausible: 'w' is not finite"]


# ----- the code a job brings and the FLARE it runs on (issue 64) ----------------------------------------------------
def byoc_site_executor(tmp_path: Path, policy: dict, edit: bool = False) -> tuple[MedflareExecutor, object, Path, str]:
    """A BYOC job deployed to site-1 whose policy is ``policy`` (``edit``: a byte of its code changed after
    export); with the digest ``medflare export`` recorded."""
    from medflare.job_code import META_KEY

    run = validated(RunConfig(method="fedavg", data={"source": "site"}, task=TASK), check_files=False)
    job = write_run_job(run, tmp_path / "jobs", task_of(run), mode="byoc")
    exported = json.loads((job / "meta.json").read_text())[META_KEY]
    if edit:
        losses = job / APP_NAME / "custom" / "medflare" / "losses" / "__init__.py"
        losses.write_text(losses.read_text() + "\n# a change after export\n")
    fl_ctx = deployed_to(job, "site-1", tmp_path / "workspaces")
    local = tmp_path / "workspaces" / "site-1" / "local"
    (local / SITE_CONFIG_FILE).write_text(json.dumps({"data": SITE_DATA, "policy": policy}))
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=True, sticky=False)
    return MedflareExecutor(), fl_ctx, local, exported


def test_a_site_runs_the_code_it_approved_and_declines_the_same_job_edited_after_export(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    from medflare.errors import SiteDeclined

    executor, fl_ctx, local, exported = byoc_site_executor(tmp_path / "a", {"approved_code": []})
    executor_ok, fl_ctx_ok, _, _ = byoc_site_executor(tmp_path / "b", {"approved_code": [exported]})
    runtime = executor_ok._get_runtime(fl_ctx_ok)  # the digest export printed: the site runs it
    runtime.close()
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: pytest.fail("the site read its data"))
    with pytest.raises(SiteDeclined, match="only its pre-installed code") as declined:
        executor._get_runtime(fl_ctx)  # a site that runs only its own installation
    assert declined.value.reason == "code"
    edited, fl_ctx_edited, local_edited, _ = byoc_site_executor(tmp_path / "c", {"approved_code": [exported]}, edit=True)
    with pytest.raises(SiteDeclined, match=r"the job brings code sha256:[0-9a-f]{64}, which is not among") as declined:
        edited._get_runtime(fl_ctx_edited)
    assert declined.value.reason == "code" and exported not in str(declined.value)  # the site computed its own
    [line] = audit_lines(local_edited)
    assert line["decision"] == "declined" and "not among the code this site approves" in line["reason"]


def test_a_site_on_a_flare_with_known_advisories_declines_every_job_in_the_simulator_too(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    from medflare.errors import SiteDeclined

    monkeypatch.setattr("medflare.advisories.installed_nvflare", lambda: "2.7.1")
    monkeypatch.setattr("medflare.flare.executor.SiteRuntime", lambda *a, **k: pytest.fail("the site read its data"))
    run = validated(RunConfig(method="fedavg", data={"source": "site"}, task=TASK), check_files=False)
    job = write_run_job(run, tmp_path / "jobs", task_of(run), mode="preinstalled")
    fl_ctx = deployed_to(job, "site-1", tmp_path / "workspaces")  # no medflare_site.json: as in the simulator
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=True, sticky=False)
    executor = MedflareExecutor()
    for _ in range(2):  # every task gets the same answer
        with pytest.raises(SiteDeclined, match="site-1 runs nvflare 2.7.1, below 2.7.2.*CVE-2026-24178") as declined:
            executor._get_runtime(fl_ctx)
        assert declined.value.reason == "platform"
