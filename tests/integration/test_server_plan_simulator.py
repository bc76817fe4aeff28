"""Issue 60, item 1, end to end in FLARE's simulator: a job whose ``deploy_map`` gives the server its own app. With
that app's plan edited (robust off, ``min_clients`` 1) the sites decline every task (``server_plan``) and no model
is aggregated without the defences; with the server's app unedited the same split job completes."""

import json
import re
import shutil
from pathlib import Path

import pytest

from medflare import contracts
from medflare.console.job_export import write_job
from medflare.plan import APP_NAME, PLAN_FILE, resolve
from medflare.run_config import RunConfig

from ._simulated import simulate

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

RUN = RunConfig(method="fedavg", rounds=1, clients=2, data={"source": "synthetic:n=300"},
                train={"max_steps": 2, "batch_size": 32}, robust={"max_norm_ratio": 5.0, "max_share": 0.6})
SERVER_APP = "app_server"


def split_job(tmp_path: Path, edit_server_plan: bool) -> Path:
    """The job of RUN with the server's app a copy of the sites' (its plan edited to robust off, min_clients 1)."""
    job = write_job(resolve(RUN, "byoc"), tmp_path / "jobs", "byoc")
    shutil.copytree(job / APP_NAME, job / SERVER_APP)
    if edit_server_plan:
        plan_file = job / SERVER_APP / "config" / PLAN_FILE
        record = json.loads(plan_file.read_text())
        record["plan"]["robust"], record["plan"]["min_clients"] = {"max_norm_ratio": 0.0, "max_share": 0.0}, 1
        plan_file.write_text(json.dumps(record, indent=2))
    meta = json.loads((job / "meta.json").read_text())
    meta["deploy_map"] = {SERVER_APP: ["server"], APP_NAME: ["site-1", "site-2"]}
    (job / "meta.json").write_text(json.dumps(meta, indent=2))
    return job


def test_sites_decline_an_edited_server_app_and_nothing_is_aggregated_without_its_defences(tmp_path: Path) -> None:
    job = split_job(tmp_path, edit_server_plan=True)
    results, logs = simulate(job, tmp_path / "ws")
    site_digest = resolve(RUN, "byoc").digest()
    assert results["plan"] != site_digest  # the server ran the edited plan ...
    assert results["rounds"] == []  # ... and aggregated nothing with it
    for site in ("site-1", "site-2"):  # each site declined in its own log line, naming both fingerprints
        line = re.search(rf"{site}: task 'train' declined: {site} declines the task: the server runs plan "
                         rf"'{results['plan']}', this site's copy of the job's plan is '{site_digest}' \(server_plan\)",
                         logs)
        assert line, f"{site} logged no server_plan decline"
    assert contracts.DECLINE_REASONS["server_plan"] in results["error"]  # the server's record of the declines


def test_a_split_job_whose_server_app_is_unedited_completes(tmp_path: Path) -> None:
    job = split_job(tmp_path, edit_server_plan=False)
    results, logs = simulate(job, tmp_path / "ws")
    digest = resolve(RUN, "byoc").digest()
    assert results["plan"] == digest and len(results["rounds"]) == 1 and "error" not in results
    assert results["site_plans"] == {"site-1": digest, "site-2": digest}
    assert "declined" not in logs
