"""Issue 61, item 2: three hospitals on their own folders, one of them without the job's first class, train one job;
the site missing a class trains its images under the job's numbers (checked against the folder each image came
from), and its log names the missing class.

Each site is built as FLARE's executor builds it (``RunPlan.localise`` with the hospital's own
``local/medflare_site.json``, then ``SiteRuntime``) and the rounds run through the in-process engine
(``benchmarks/inprocess.py``: the job's plan and the server's round core). FLARE's simulator cannot hold this case:
it copies one workspace-level ``local/`` into every site, so its sites cannot read different folders.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image

from medflare.plan import resolve, validated
from medflare.run_config import RunConfig
from medflare.site_config import SiteFile
from medflare.site_runtime import SiteRuntime
from tests.benchmarks.conftest import load_benchmark

JOB = ["effusion", "nodule", "normal"]
FOLDERS = {  # each hospital's class folders and images; site-3 has no effusion, site-2 spells normal its own way
    "site-1": {"effusion": 12, "nodule": 12, "normal": 12},
    "site-2": {"effusion": 12, "nodule": 12, "Normal": 12},
    "site-3": {"nodule": 14, "normal": 20},
}
CLASS_MAPS = {"site-2": {"Normal": "normal"}}


def hospital_file(tmp_path: Path, site: str) -> SiteFile:
    rng = np.random.default_rng(len(site))
    images = tmp_path / site / "images"
    for name, count in FOLDERS[site].items():
        (images / name).mkdir(parents=True)
        for index in range(count):
            Image.fromarray(rng.integers(0, 256, (12, 12), dtype=np.uint8)).save(images / name / f"{index}.png")
    data = {"source": f"folder:{images}", **({"class_map": CLASS_MAPS[site]} if site in CLASS_MAPS else {})}
    local = tmp_path / site / "local"
    local.mkdir(parents=True)
    (local / "medflare_site.json").write_text(json.dumps({"data": data}))
    return SiteFile.of(local)


def test_a_site_missing_a_class_trains_in_the_jobs_order_beside_two_full_sites(tmp_path: Path, monkeypatch) -> None:
    engine: ModuleType = load_benchmark("inprocess")
    task = {"num_classes": 3, "in_channels": 1, "image_size": 12, "class_names": JOB}
    run = validated(RunConfig(method="fedavg", clients=3, rounds=2, data={"source": "site"}, task=task,
                              train={"max_steps": 2, "batch_size": 8}), check_files=False)
    plan = resolve(run, "byoc")
    files = {site.name: hospital_file(tmp_path, site.name) for site in plan.sites}
    logs: dict[str, list[str]] = {site: [] for site in files}

    class HospitalSites(engine.InProcessSites):
        """The sites as the executor builds them at a hospital: from its own medflare_site.json, not simulated."""

        def __init__(self, plan) -> None:
            self.sites, self.rng = {}, {}
            for site in plan.sites:
                settings, index = plan.localise(site.name, files[site.name], simulated=False)
                self.rng[site.name] = []
                with self.at(site.name):
                    self.sites[site.name] = SiteRuntime(settings, site.name, index, log=logs[site.name].append)

    monkeypatch.setattr(engine, "InProcessSites", HospitalSites)
    built: dict[str, SiteRuntime] = {}
    rounds = []
    engine.run_rounds(plan, on_sites=lambda sites: built.update(sites.sites), on_round=rounds.append)

    assert len(rounds) == 2 and all(sorted(u.site for u in done.accepted) == sorted(files) for done in rounds)
    for site, runtime in built.items():
        assert runtime.data.num_classes == 3
        for split in (runtime.data.train, runtime.data.val, runtime.data.test):
            image_set = split.images
            given = [CLASS_MAPS.get(site, {}).get(Path(path).parent.name, Path(path).parent.name)
                     for path in image_set.paths]
            assert [JOB[label] for label in image_set.labels] == given, site  # the label it was given, job's order
    assert built["site-3"].data.class_counts[JOB.index("effusion")] == 0
    assert any("site-3: this site holds no images of the job's class(es) effusion" in line for line in logs["site-3"])
    assert not any("holds no images" in line for line in logs["site-1"] + logs["site-2"])
