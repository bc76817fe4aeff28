"""A real FLARE POC on loopback (mTLS kits from provisioning/project.yml): one POC for the whole module.

Two sites (opted in to job-provided data) run one method's job in pre-installed mode and again in BYOC mode
(submitted by the project's lead, at the same time). A third site is configured for pre-installed mode only: it
runs a pre-installed job on its own site-local data and refuses a BYOC job, a job naming its own data, and a
code-free job naming a medflare function that rewrites site policies (its ``local/`` stays byte-identical, as
does the server's, but for the site's audit log, where medflare records each job that reached its executor). A ``member`` cannot submit at all. No site log reaches the server's job store.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from medflare.console.deploy.poc import PROCESS_TMP, PocSession, retarget_job, write_run_outputs
from medflare.console.deploy.policies import SERVER_STORAGE, site_data_config
from medflare.registry import get_method
from medflare.run_config import RunConfig
from medflare.site_policy import AUDIT_FILE, verify_audit

from .._plans import write_run_job

pytestmark = pytest.mark.slow

METHOD = "fedavg"
QUICK = {"max_steps": 3, "batch_size": 32}
SHARED_DATA = {"source": "synthetic:n=400", "partition": "iid"}
JOB_TIMEOUT = 240


def two_site_run(name: str) -> RunConfig:
    return RunConfig(method=METHOD, rounds=2, clients=2, data=dict(SHARED_DATA), train=dict(QUICK), name=name)


def site3_run(name: str) -> RunConfig:
    """A one-site job that reads its data from the site's own local/medflare_site.json."""
    task = {"num_classes": 5, "in_channels": 3, "image_size": 28,  # what synthetic:n=200 yields
            "class_names": [f"class_{k}" for k in range(5)]}
    return RunConfig(method=METHOD, rounds=1, clients=1, data={"source": "site"}, task=task, train=dict(QUICK),
                     name=name)


@pytest.fixture(scope="module")
def poc(tmp_path_factory, poc_lock, poc_port):
    root = tmp_path_factory.mktemp("poc")
    # tied: the POC dies with this test process, also when a cancelled run (CI, Ctrl-C) skips the teardown
    session = PocSession(root / "poc", port=poc_port, echo=lambda line: None, tied=True)
    timings: dict[str, float] = {}
    jobs: dict[str, dict] = {}
    try:
        t0 = time.time()
        session.prepare(3, site_modes={"site-3": "preinstalled"}, allow_job_data=True)
        site3_local = session.kit("site-3") / "local" / "medflare_site.json"  # its own data, no opt-in
        site3_local.write_text(json.dumps(site_data_config("synthetic:n=200")))
        session.start(exclude=["site-3"])
        timings["prepare_and_start"] = time.time() - t0
        for mode in ("preinstalled", "byoc"):
            job_dir = write_run_job(two_site_run(f"{METHOD}-{mode}"), root / "jobs" / mode, mode=mode)
            jobs[mode] = {"dir": job_dir, "id": session.submit(job_dir)}
        t1 = time.time()
        for job in jobs.values():
            job["status"] = session.wait(job["id"], timeout=JOB_TIMEOUT)
        timings["two_jobs"] = time.time() - t1
        for job in jobs.values():
            if job["status"] == "FINISHED:COMPLETED":
                job["download"] = session.download(job["id"], root / "downloads")
        yield {"session": session, "jobs": jobs, "root": root, "timings": timings}
    finally:
        session.stop()
        session.clean()


@pytest.mark.smoke  # the one POC of make test
def test_preinstalled_job_completes_without_carrying_code(poc) -> None:
    job = poc["jobs"]["preinstalled"]
    assert job["status"] == "FINISHED:COMPLETED", poc["session"].server_log()[-3000:]
    assert not (job["dir"] / "app" / "custom").exists()
    meta = json.loads((job["dir"] / "meta.json").read_text())
    assert meta["scope"] == f"medflare-{METHOD}"  # the sites applied this method's privacy filters


@pytest.mark.smoke  # the one POC of make test
def test_byoc_job_completes_carrying_code(poc) -> None:
    job = poc["jobs"]["byoc"]
    assert job["status"] == "FINISHED:COMPLETED", poc["session"].server_log()[-3000:]
    assert (job["dir"] / "app" / "custom" / "medflare" / "flare" / "executor.py").is_file()


@pytest.mark.parametrize("mode", ["preinstalled", "byoc"])
@pytest.mark.smoke  # the one POC of make test
def test_downloaded_results_become_the_usual_report(poc, mode: str, tmp_path: Path) -> None:
    job = poc["jobs"][mode]
    assert "download" in job, f"{mode} job did not complete: {job['status']}"
    extra = {"env": "poc", "mode": mode, "job_id": job["id"]}
    summary = write_run_outputs(job["download"], tmp_path, None, extra)  # the plan the downloaded job carries
    for name in ("summary.json", "rounds.csv", "report.md", "FL_global_model.pt"):
        assert (tmp_path / name).is_file(), name
    assert summary["rounds_completed"] == 2 and not summary["error"]
    assert set(summary["per_round"][-1]["share"]) == {"site-1", "site-2"}
    assert summary["final"]["loss"] != pytest.approx(summary["initial"]["loss"], rel=1e-6)  # the trained model
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["deployment"]["mode"] == mode
    declared = set(get_method(METHOD).payload.allowed_meta())  # what the site policy let through
    sent = set(on_disk["payload"]["site-1"]["meta_keys"])
    assert {"n_samples", "eval_val", "eval_test"} <= sent <= declared


@pytest.mark.smoke  # the one POC of make test
def test_member_cannot_submit(poc) -> None:
    session: PocSession = poc["session"]
    member = next(name for name, role in session.state["admins"].items() if role == "member")
    kept = session.workspace / PROCESS_TMP
    before = set(kept.iterdir())
    reply = session.try_submit(poc["jobs"]["preinstalled"]["dir"], member)
    assert reply["exit_code"] != 0
    assert "not authorized" in json.dumps(reply), reply
    # FLARE's server keeps the refused job it received, zipped, in its temporary folder: the POC's processes have
    # theirs in the workspace (removed with it), so the machine's /tmp keeps no copy of the job
    left = [f for f in set(kept.iterdir()) - before if zipfile.is_zipfile(f)]
    assert any(name.endswith("/meta.json") for f in left for name in zipfile.ZipFile(f).namelist()), left


@pytest.mark.smoke  # the one POC of make test
def test_preflight_passes_a_site_against_its_job_with_the_server_up_and_writes_nothing(poc, tmp_path: Path) -> None:
    """Issue 48, item 4: the admin's command, as a user runs it, against the running POC server (FLARE's own
    connectivity check with the site's certificate) and a job for that site."""
    kit = poc["session"].kit("site-3")
    job_dir = write_run_job(site3_run("site3-preflight"), tmp_path / "job", mode="preinstalled")
    retarget_job(job_dir, ["site-3"], "site3-preflight")
    before = {folder: _tree_bytes(kit / folder) for folder in ("local", "startup")}
    done = subprocess.run([sys.executable, "-m", "medflare.console.cli", "preflight", str(kit), "--job", str(job_dir),
                           "--json"], capture_output=True, text=True, timeout=180)
    report = json.loads(done.stdout)
    statuses = {check["check"]: check["status"] for check in report["checks"]}
    assert done.returncode == 0 and report["overall"] != "FAIL", done.stdout + done.stderr
    for name in ("kit files", "certificate", "server", "versions", "site file", "policy", "data", "images",
                 "classes", "job", "job policy", "job data"):
        assert statuses[name] == "PASS", (name, report)
    assert {folder: _tree_bytes(kit / folder) for folder in before} == before


SITE3_JOBS = ("preinstalled", "byoc", "tamper", "data")


@pytest.fixture(scope="module")
def site3(poc) -> dict:
    """site-3 (pre-installed mode, its own data, no opt-in to job data) gets four jobs at once: a pre-installed
    and a BYOC job on its own data, a code-free job naming a policy-writing medflare function as a component of
    both the site and the server, and a job naming its own data. Returns their ids, final statuses and the
    ``local/`` bytes of site-3 and the server before and after."""
    session: PocSession = poc["session"]
    server = session.state["server"]
    session.start_site("site-3")
    before = {name: _tree_bytes(session.kit(name) / "local") for name in ("site-3", server)}
    jobs = {}
    t0 = time.time()
    for name in SITE3_JOBS:
        run = two_site_run(f"site3-{name}") if name == "data" else site3_run(f"site3-{name}")
        mode = "byoc" if name == "byoc" else "preinstalled"
        job_dir = write_run_job(run, poc["root"] / "site3-jobs" / name, mode=mode)
        retarget_job(job_dir, ["site-3"], f"site3-{name}")
        if name == "tamper":  # both sides build their configs at job start, each refuses on its own
            for side, kit in (("client", "site-3"), ("server", server)):
                tamper = {"id": "tamper", "path": "medflare.console.deploy.policies.install_site_policies",
                          "args": {"kit_dir": str(session.kit(kit)), "mode": "byoc"}}
                _add_component(job_dir / "app" / "config" / f"config_fed_{side}.json", tamper)
        jobs[name] = session.submit(job_dir)
    statuses = {name: session.wait(job_id, timeout=JOB_TIMEOUT) for name, job_id in jobs.items()}
    poc["timings"]["site3_jobs"] = time.time() - t0
    after = {name: _tree_bytes(session.kit(name) / "local") for name in before}
    return {"ids": jobs, "statuses": statuses, "local_before": before, "local_after": after}


@pytest.mark.heavy  # make test-heavy: a fourth site and its four jobs
def test_preinstalled_site_runs_preinstalled_jobs_and_refuses_byoc(poc, site3) -> None:
    session: PocSession = poc["session"]
    assert site3["statuses"]["preinstalled"] == "FINISHED:COMPLETED", session.server_log()[-3000:]
    assert site3["statuses"]["byoc"] != "FINISHED:COMPLETED"
    byoc = site3["ids"]["byoc"]
    refusals = [line for line in session.server_log().splitlines() if byoc in line and "BYOC" in line]
    assert any("site-3: NVFLARE_ERROR: BYOC not permitted" in line for line in refusals), refusals


@pytest.mark.heavy  # make test-heavy: a fourth site and its four jobs
def test_site_refuses_tamper_jobs_and_job_chosen_data(poc, site3) -> None:
    """A code-free job naming a policy-writing medflare function, at the site or at the server, is refused
    before it runs, and both ``local/`` folders stay byte-identical (but for medflare's own audit log at the site,
    whose every line is a record of one of these jobs); a job naming its own data is refused."""
    session: PocSession = poc["session"]
    refused = {name: site3["statuses"][name] for name in ("tamper", "data")}
    assert all(status != "FINISHED:COMPLETED" for status in refused.values()), refused
    after = dict(site3["local_after"]["site-3"])
    audit = after.pop(AUDIT_FILE, b"").decode()  # medflare's own record of the jobs that reached its executor
    assert {**site3["local_after"], "site-3": after} == site3["local_before"]  # the policies are as they were
    chain = verify_audit(audit.encode())  # one hash-chained line per decision, task, failure and job end
    assert chain.broken is None and chain.records, chain
    assert {r["job_id"] for r in chain.records} <= set(site3["ids"].values())
    assert all(r["event"] in ("decision", "task", "failed", "end") and len(r["plan"]) == 12 for r in chain.records)
    assert {r["decision"] for r in chain.records if r["event"] == "decision"} <= {"accepted", "declined"}
    # the tamper component's index depends on how many components the job has (tracking adds some)
    refusal = re.compile(r"Component 'medflare\.console\.deploy\.policies\.install_site_policies' at config path "
                         r"'components\.#\d+' is not in")
    site_log = _site3_job_log(session, site3["ids"]["tamper"])
    assert refusal.search(site_log), site_log[-2000:]
    server_log = _server_job_log(session, site3["ids"]["tamper"])
    assert refusal.search(server_log), server_log[-2000:]
    data_log = _site3_job_log(session, site3["ids"]["data"])
    assert "refused: the job names its own data (source 'synthetic:n=400')" in data_log, data_log[-2000:]


@pytest.mark.heavy  # make test-heavy: a fourth site and its four jobs
def test_no_site_log_reaches_the_server_and_the_job_store_is_private(poc, site3) -> None:
    """Sites do not stream or upload logs (ERRORLOG_<site> carried a data path); the job store is in the kit."""
    session: PocSession = poc["session"]
    server_kit = session.kit(session.state["server"])
    resources = json.loads((server_kit / "local" / "resources.json").read_text())
    job_store = Path(next(c for c in resources["components"] if c["id"] == "job_manager")["args"]["uri_root"])
    assert job_store == server_kit.resolve() / SERVER_STORAGE["job_store"]
    assert job_store.stat().st_mode & 0o777 == 0o700
    job_folders = [p for p in job_store.iterdir() if p.is_dir()]
    assert {job["id"] for job in poc["jobs"].values()} <= {p.name for p in job_folders}
    uploaded = [p.name for folder in job_folders for p in folder.iterdir() if p.name.startswith(("ERRORLOG", "LOG_"))]
    assert uploaded == [], uploaded


@pytest.mark.heavy  # make test-heavy: a fourth site and its four jobs
def test_poc_stays_within_budget(poc, site3) -> None:
    timings = poc["timings"]
    assert timings["prepare_and_start"] < 90, timings
    assert timings["two_jobs"] < 2 * JOB_TIMEOUT, timings
    assert timings["site3_jobs"] < 2 * JOB_TIMEOUT, timings


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _add_component(config_file: Path, component: dict) -> None:
    config = json.loads(config_file.read_text())
    config["components"] = [*config.get("components", []), component]
    config_file.write_text(json.dumps(config, indent=2))


def _site3_job_log(session: PocSession, job_id: str) -> str:
    """The job's log at site-3 (it stays in the site's kit: sites upload no logs)."""
    return (session.kit("site-3") / job_id / "log.txt").read_text(errors="replace")


def _server_job_log(session: PocSession, job_id: str) -> str:
    """The server's log of a finished job, from its workspace in the server's job store (what a download gets)."""
    archive = session.kit(session.state["server"]) / SERVER_STORAGE["job_store"] / job_id / "workspace"
    with zipfile.ZipFile(archive) as workspace:
        return workspace.read("log.txt").decode(errors="replace")
