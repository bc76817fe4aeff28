"""A real FLARE POC on loopback (mTLS kits from provisioning/project.yml): one POC for the whole module.

Two sites run one method's job in pre-installed mode and again in BYOC mode (submitted by the project's
lead, at the same time). A third site is configured for pre-installed mode only: it runs a pre-installed
job on its own site-local data and refuses a BYOC job. A ``member`` cannot submit at all.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from medflare.deploy.poc import PocSession, export_poc_job, retarget_job, write_run_outputs
from medflare.deploy.policies import site_data_config
from medflare.registry import get_method
from medflare.run_config import RunConfig

pytestmark = pytest.mark.slow

METHOD = "fedavg"
QUICK = {"max_steps": 3, "batch_size": 32}
SHARED_DATA = {"source": "synthetic:n=400", "partition": "iid"}
JOB_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_site_run(name: str) -> RunConfig:
    return RunConfig(method=METHOD, rounds=2, clients=2, data=dict(SHARED_DATA), train=dict(QUICK), name=name)


def site3_run(name: str) -> RunConfig:
    """A one-site job that reads its data from the site's own local/medflare_site.json."""
    task = {"num_classes": 5, "in_channels": 3, "image_size": 28}  # what synthetic:n=200 yields
    return RunConfig(method=METHOD, rounds=1, clients=1, data={"source": "site"}, task=task, train=dict(QUICK),
                     name=name)


@pytest.fixture(scope="module")
def poc(tmp_path_factory):
    root = tmp_path_factory.mktemp("poc")
    session = PocSession(root / "poc", port=free_port(), echo=lambda line: None)
    timings: dict[str, float] = {}
    jobs: dict[str, dict] = {}
    try:
        t0 = time.time()
        session.prepare(3, site_modes={"site-3": "preinstalled"})
        site3_local = session.kit("site-3") / "local" / "medflare_site.json"
        site3_local.write_text(json.dumps(site_data_config("synthetic:n=200")))
        session.start(exclude=["site-3"])
        timings["prepare_and_start"] = time.time() - t0
        for mode in ("preinstalled", "byoc"):
            job_dir = export_poc_job(two_site_run(f"{METHOD}-{mode}"), root / "jobs" / mode, mode)
            jobs[mode] = {"dir": job_dir, "id": session.submit(job_dir)}
        t1 = time.time()
        for job in jobs.values():
            job["status"] = session.wait(job["id"], timeout=JOB_TIMEOUT)
        timings["two_jobs"] = time.time() - t1
        for mode, job in jobs.items():
            if job["status"] == "FINISHED:COMPLETED":
                job["download"] = session.download(job["id"], root / "downloads")
        yield {"session": session, "jobs": jobs, "root": root, "timings": timings}
    finally:
        session.stop()
        session.clean()


def test_preinstalled_job_completes_without_carrying_code(poc) -> None:
    job = poc["jobs"]["preinstalled"]
    assert job["status"] == "FINISHED:COMPLETED", poc["session"].server_log()[-3000:]
    assert not (job["dir"] / "app" / "custom").exists()
    meta = json.loads((job["dir"] / "meta.json").read_text())
    assert meta["scope"] == f"medflare-{METHOD}"  # the sites applied this method's privacy filters


def test_byoc_job_completes_carrying_code(poc) -> None:
    job = poc["jobs"]["byoc"]
    assert job["status"] == "FINISHED:COMPLETED", poc["session"].server_log()[-3000:]
    assert (job["dir"] / "app" / "custom" / "medflare" / "flare" / "executor.py").is_file()


@pytest.mark.parametrize("mode", ["preinstalled", "byoc"])
def test_downloaded_results_become_the_usual_report(poc, mode: str, tmp_path: Path) -> None:
    job = poc["jobs"][mode]
    assert "download" in job, f"{mode} job did not complete: {job['status']}"
    extra = {"env": "poc", "mode": mode, "job_id": job["id"]}
    summary = write_run_outputs(two_site_run(f"{METHOD}-{mode}"), job["download"], tmp_path, None, extra)
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


def test_member_cannot_submit(poc) -> None:
    session: PocSession = poc["session"]
    member = next(name for name, role in session.state["admins"].items() if role == "member")
    reply = session.try_submit(poc["jobs"]["preinstalled"]["dir"], member)
    assert reply["exit_code"] != 0
    assert "not authorized" in json.dumps(reply), reply


def test_preinstalled_site_runs_preinstalled_jobs_and_refuses_byoc(poc) -> None:
    session: PocSession = poc["session"]
    root: Path = poc["root"]
    session.start_site("site-3")
    jobs = {}
    for mode in ("preinstalled", "byoc"):
        job_dir = export_poc_job(site3_run(f"site3-{mode}"), root / "site3-jobs" / mode, mode)
        retarget_job(job_dir, ["site-3"], f"site3-{mode}")
        jobs[mode] = session.submit(job_dir)
    byoc_status = session.wait(jobs["byoc"], timeout=JOB_TIMEOUT)
    preinstalled_status = session.wait(jobs["preinstalled"], timeout=JOB_TIMEOUT)
    assert preinstalled_status == "FINISHED:COMPLETED", session.server_log()[-3000:]
    assert byoc_status != "FINISHED:COMPLETED"
    refusals = [line for line in session.server_log().splitlines() if jobs["byoc"] in line and "BYOC" in line]
    assert any("site-3: NVFLARE_ERROR: BYOC not permitted" in line for line in refusals), refusals


def test_poc_stays_within_budget(poc) -> None:
    timings = poc["timings"]
    assert timings["prepare_and_start"] < 90, timings
    assert timings["two_jobs"] < 2 * JOB_TIMEOUT, timings
