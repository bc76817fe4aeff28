"""The site's executor starts from the job's plan, rebuilt from what FLARE deployed, and from the hospital's own
``local/medflare_site.json``, read once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvflare.apis.fl_constant import ReservedKey

from medflare import readback
from medflare.errors import DataError
from medflare.flare.executor import MedflareExecutor
from medflare.job_export import export_job, job_robust
from medflare.plan import build_plan
from medflare.run_config import RunConfig
from medflare.site_runtime import SITE_CONFIG_FILE

from ..test_plan import deployed_to

SITE_DATA = {"source": "synthetic:n=60,classes=2,channels=1,size=28", "augment": "none"}


def test_a_site_trains_what_the_plan_says_with_the_data_and_model_its_own_file_names(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    run = RunConfig(method="fedavg", clients=2, data={"source": "site"}, train={"lr": 0.02, "batch_size": 8},
                    site_train={"site-2": {"lr": 0.5}}, task={"num_classes": 2, "in_channels": 1, "image_size": 28})
    run.validate(check_files=False)
    plan = build_plan(run, run.task_spec(), job_robust(run, "preinstalled"))
    job = export_job(run, tmp_path / "jobs", run.task_spec(), mode="preinstalled")
    fl_ctx = deployed_to(job, "site-2", tmp_path / "workspaces")
    site_file = tmp_path / "workspaces" / "site-2" / "local" / SITE_CONFIG_FILE
    site_file.write_text(json.dumps({"data": SITE_DATA}))
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-2", private=True, sticky=False)
    reads = []
    load_json = readback.load_json
    monkeypatch.setattr(readback, "load_json", lambda path, *args, **kw: reads.append(path) or load_json(path, *args, **kw))

    args = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())["executors"][0]["executor"]
    runtime = MedflareExecutor(**args["args"])._get_runtime(fl_ctx)
    try:
        # one parse serves data, model, DP-SGD and processes
        assert [Path(p) for p in reads if Path(p).name == SITE_CONFIG_FILE] == [site_file]
        assert runtime.train_cfg == plan.site("site-2").train["train"] and runtime.train_cfg.lr == 0.5
        assert runtime.settings.data == {**SITE_DATA, "local": True, "num_sites": 1}
        assert (runtime.settings.model, runtime.settings.method_args) == (plan.model, plan.method_args)
    finally:
        runtime.close()


def test_a_site_without_its_data_file_says_so_before_anything_trains(tmp_path: Path) -> None:
    run = RunConfig(method="fedavg", data={"source": "site"}, task={"num_classes": 2, "in_channels": 1,
                                                                    "image_size": 28})
    run.validate(check_files=False)
    job = export_job(run, tmp_path / "jobs", run.task_spec(), mode="preinstalled")
    fl_ctx = deployed_to(job, "site-1", tmp_path / "workspaces")
    fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=True, sticky=False)
    args = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())["executors"][0]["executor"]
    with pytest.raises(DataError, match="this site has no data configured"):
        MedflareExecutor(**args["args"])._get_runtime(fl_ctx)
