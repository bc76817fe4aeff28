"""Issue 61, item 2, in a real FLARE POC: three hospitals read their own folders (``local/medflare_site.json``), one
without the job's first class and one with an extra class it leaves out (``class_map`` null). All three train the
job; the server's per-site test results number each site's classes in the job's order (the site lacking effusion
has no effusion test image under the job's number 0), and the site's own log names the missing class.

FLARE's simulator copies one workspace ``local/`` into every site, so it cannot give sites different folders; a POC's
kits each have their own. The in-process seam test is tests/integration/test_missing_class_sites.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.console.deploy.poc import PocSession, write_run_outputs
from medflare.console.deploy.policies import site_data_config
from medflare.run_config import RunConfig
from medflare.site_config import SITE_CONFIG_FILE, TaskSpec

from .._plans import write_run_job

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

JOB = ["effusion", "nodule", "normal"]
FOLDERS = {  # each hospital's class folders; site-3 has no effusion, site-2 an extra class the job lacks
    "site-1": {"effusion": 20, "nodule": 20, "normal": 20},
    "site-2": {"effusion": 20, "nodule": 20, "normal": 20, "cardiomegaly": 7},
    "site-3": {"nodule": 20, "normal": 27},
}
CLASS_MAPS = {"site-2": {"cardiomegaly": None}}
TASK = {"num_classes": 3, "in_channels": 1, "image_size": 12, "class_names": JOB}


def hospital_images(root: Path, site: str) -> Path:
    rng = np.random.default_rng(len(site))
    for name, count in FOLDERS[site].items():
        (root / name).mkdir(parents=True)
        for index in range(count):
            Image.fromarray(rng.integers(0, 256, (12, 12), dtype=np.uint8)).save(root / name / f"{index}.png")
    return root


def test_three_hospitals_one_missing_a_class_train_in_the_jobs_order(tmp_path: Path, poc_lock, poc_port) -> None:
    session = PocSession(tmp_path / "poc", port=poc_port, echo=lambda line: None, tied=True)
    try:
        session.prepare(3)
        for site in FOLDERS:
            options = {"class_map": CLASS_MAPS[site]} if site in CLASS_MAPS else {}
            config = site_data_config(f"folder:{hospital_images(tmp_path / site, site)}", **options)
            (session.kit(site) / "local" / SITE_CONFIG_FILE).write_text(json.dumps(config))
        session.start()
        run = RunConfig(method="fedavg", rounds=2, clients=3, min_clients=3, name="missing-class",
                        data={"source": "site"}, task=TASK, train={"max_steps": 2, "batch_size": 8})
        job_id = session.submit(write_run_job(run, tmp_path / "jobs", task=TaskSpec(**TASK), mode="preinstalled"))
        status = session.wait(job_id, timeout=480)
        assert status == "FINISHED:COMPLETED", session.server_log()[-3000:]
        summary = write_run_outputs(session.download(job_id, tmp_path / "download"), tmp_path / "out", None,
                                    {"env": "poc", "job_id": job_id})
        site_logs = {site: "\n".join(path.read_text(errors="replace")
                                     for path in session.kit(site).rglob("log.txt")) for site in FOLDERS}
    finally:
        session.stop()
        session.clean()

    assert summary["rounds_completed"] == 2 and set(summary["per_round"][-1]["share"]) == set(FOLDERS)
    recall = {site: metrics["per_class_recall"] for site, metrics in summary["final"]["by_site"].items()}
    assert recall["site-3"][JOB.index("effusion")] is None, recall  # no effusion test image under the job's 0
    assert all(value is not None for value in recall["site-3"][1:]), recall
    assert all(value is not None for site in ("site-1", "site-2") for value in recall[site]), recall
    assert "site-3: this site holds no images of the job's class(es) effusion" in site_logs["site-3"]
    assert "site-2: class_map leaves out cardiomegaly: 7 image(s)" in site_logs["site-2"]
    assert "holds no images" not in site_logs["site-1"] + site_logs["site-2"]
