"""A real POC whose second site's policy declines the job: ``medflare watch JOB_ID`` (as the lead, from another
process) prints FLARE's status and, on the next line, why: the declining site and its policy's reason, which
otherwise is one line in the server's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from medflare.console.deploy.poc import PocSession
from medflare.console.deploy.policies import site_data_config
from medflare.run_config import RunConfig
from medflare.site_config import SITE_CONFIG_FILE

from .._plans import write_run_job

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

ACCEPTED_METHODS = ["fedprox"]  # site-2 accepts these only, so a fedavg job is declined there


def test_watch_names_the_declining_site_and_its_reason(tmp_path: Path, poc_lock, poc_port) -> None:
    session = PocSession(tmp_path / "poc", port=poc_port, echo=lambda line: None, tied=True)
    try:
        session.prepare(2, allow_job_data=True)
        declining = session.kit("site-2") / "local" / SITE_CONFIG_FILE
        declining.write_text(json.dumps({**site_data_config(allow_job_data=True),
                                         "policy": {"methods": ACCEPTED_METHODS}}))
        session.start()
        run = RunConfig(method="fedavg", rounds=2, clients=2, min_clients=2, name="declined",
                        data={"source": "synthetic:n=300", "partition": "iid"}, train={"max_steps": 2})
        job_id = session.submit(write_run_job(run, tmp_path / "jobs"))
        env = {k: v for k, v in os.environ.items() if k != "NVFLARE_STARTUP_KIT_DIR"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2] / "custom"),
                                                          env.get("PYTHONPATH")]))
        watched = subprocess.run(
            [sys.executable, "-m", "medflare.console.cli", "watch", job_id, "--poc", str(tmp_path / "poc"),
             "--interval", "1"], capture_output=True, text=True, timeout=600, env=env,
        )
    finally:
        session.stop()
        session.clean()
    lines = watched.stdout.splitlines()
    assert watched.returncode != 0, watched.stdout
    assert lines[-1].startswith(f"medflare: job {job_id}: FINISHED:"), watched.stdout
    assert "COMPLETED" not in lines[-1]
    why = lines[-2]  # FLARE's status follows the cause, the two last lines
    assert why.startswith("  why: round 1: site-2 "), watched.stdout + watched.stderr[-2000:]
    assert "site-2 EXECUTION_EXCEPTION: declined: its site policy declines the job" in why, why
    assert "site-1" not in why.split("|")[0]  # the site that trained is not named as a cause
