"""Issue 64, end to end in FLARE's simulator: sites whose ``local/medflare_site.json`` policy approves the digest
``medflare export`` printed run the exported job, and decline the same job once a byte of its code was edited (each
site computes the digest of the code FLARE deployed to it; the server records the sites' ``code`` declines).

The simulator copies its workspace's ``local/`` folder into every participant's own ``local/``, so one site file
there is every site's (the simulated data needs its ``allow_job_data`` opt-in, as a test site's file has)."""

import json
import re
from pathlib import Path

import pytest

from medflare import contracts
from medflare.console.job_export import job_code_digest, write_job
from medflare.plan import APP_NAME, resolve
from medflare.run_config import RunConfig

from ._simulated import simulate

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

RUN = RunConfig(method="fedavg", rounds=1, clients=2, data={"source": "synthetic:n=300"},
                train={"max_steps": 2, "batch_size": 32})


def with_site_file(workspace: Path, policy: dict) -> Path:
    """``workspace`` whose simulated sites each get a ``medflare_site.json`` with ``policy``."""
    (workspace / "local").mkdir(parents=True)
    (workspace / "local" / "medflare_site.json").write_text(json.dumps({"allow_job_data": True, "policy": policy}))
    return workspace


def test_sites_run_the_exported_job_whose_digest_they_approve_and_decline_it_edited(tmp_path: Path) -> None:
    job = write_job(resolve(RUN, "byoc"), tmp_path / "jobs", "byoc")
    digest = job_code_digest(job)
    results, logs = simulate(job, with_site_file(tmp_path / "ws-exported", {"approved_code": [digest]}))
    assert len(results["rounds"]) == 1 and "error" not in results, results.get("error")
    for site in ("site-1", "site-2"):
        assert f"{site}: the job's code is {digest}" in logs  # each site's own digest of what it received
    module = job / APP_NAME / "custom" / "medflare" / "losses" / "__init__.py"
    module.write_text(module.read_text() + "\n# edited after export\n")
    edited = job_code_digest(job)
    results, logs = simulate(job, with_site_file(tmp_path / "ws-edited", {"approved_code": [digest]}))
    assert results["rounds"] == [] and contracts.DECLINE_REASONS["code"] in results["error"]
    for site in ("site-1", "site-2"):
        assert re.search(rf"{site} declines the job: the job brings code {edited}, which is not among the code this "
                         rf"site approves", logs), f"{site} logged no code decline"
