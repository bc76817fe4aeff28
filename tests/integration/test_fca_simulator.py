"""FCA through FLARE's simulator: the personal head never travels (recorded real messages, both directions, every
round), the final summary carries FCA's figures, and a restarted site reloads its personal head bit for bit.

Both tests read one job (FCA's recipe in FLARE's SimEnv, its workspace kept): a 3-site simulator run costs about a
minute of CPU on the 2-core CI machine, and the second test only needs the state files the first job leaves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from medflare.evaluation import SPECIALIZATION
from medflare.plan import task_of, validated
from medflare.registry import get_method
from medflare.run_config import RunConfig

from .test_every_method_simulator import run_recipe_in_simenv

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

# Long tail with classes missing per site; each site's test split follows its own class mix.
DATA = {"source": "synthetic:n=480,classes=4,imbalance=5", "partition": "class-dirichlet:20/10/5/1:0.3",
        "eval_split": "like_train"}
PERSONAL = "personal_head."


def fca_run(**overrides) -> RunConfig:
    # cnn, not FCA's default EfficientNet-Lite0: these tests are about what travels and is stored, and stay < 60 s
    settings = {"method": "fca", "model": "cnn", "rounds": 3, "clients": 3, "data": DATA,
                "train": {"max_steps": 2, "batch_size": 32}}
    return RunConfig(**{**settings, **overrides})


class FcaJob(NamedTuple):
    run: RunConfig
    out: Path  # what `medflare run` writes (summary, global model, each site's payload audit)
    summary: dict
    workspace: Path  # FLARE's simulator workspace: each site's saved state


@pytest.fixture(scope="module")
def fca_job(tmp_path_factory: pytest.TempPathFactory) -> FcaJob:
    run = fca_run(audit=True)
    run = validated(run)
    out, summary, results, workspace = run_recipe_in_simenv(run, tmp_path_factory.mktemp("fca"))
    assert "error" not in results, results.get("error")
    return FcaJob(run, out, summary, workspace)


def test_no_personal_head_key_travels_and_the_summary_reports_generalization_and_specialization(fca_job: FcaJob) -> None:
    run, out, summary = fca_job.run, fca_job.out, fca_job.summary
    assert summary["rounds_completed"] == 3
    for site in run.site_names:
        path = out / "sites" / site / "medflare_payload_audit.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        seen = {(r["direction"], r["task"]) for r in records}
        assert {("task", "train"), ("result", "train"), ("task", "validate")} <= seen, seen
        for record in records:  # every real task and result this site saw or sent, in every round
            assert not any(key.startswith(PERSONAL) for key in record["arrays"]), record
        trained = [r for r in records if r["task"] == "train"]
        assert len(trained) == 2 * run.rounds  # one task and one result per round
        assert all("head.weight" in r["arrays"] for r in trained)  # the federated head does travel
    persisted = torch.load(out / "FL_global_model.pt", weights_only=False)["model"]
    assert "head.weight" in persisted and not any(k.startswith(PERSONAL) for k in persisted)

    final = summary["final"]
    for key in ("generalization_bacc", "generalization_bauc", "specialization_bacc", "specialization_bauc"):
        assert 0.0 <= final[key] <= 1.0, key
    assert final["generalization_bacc"] == final["balanced_accuracy"]  # the global model on the pooled test splits
    special = final["extra"][SPECIALIZATION]
    assert set(final["by_site"]) == set(special["by_site"]) == set(final["specialization_by_site"]) == set(run.site_names)
    assert final["specialization_bacc"] == pytest.approx(
        np.mean([m["balanced_accuracy"] for m in special["by_site"].values()])
    )
    assert final["gs_mean_bacc"] == pytest.approx((final["generalization_bacc"] + final["specialization_bacc"]) / 2)
    assert special["by_site"] != final["by_site"]  # the personal models are scored, not the global one again


def test_a_restarted_site_reloads_its_personal_head_bit_for_bit(fca_job: FcaJob, tmp_path: Path) -> None:
    from medflare.site_config import SiteSettings
    from medflare.site_runtime import SITE_STATE_FILE, SiteRuntime

    run, workspace = fca_job.run, fca_job.workspace
    task = task_of(run)
    settings = SiteSettings(spec=get_method("fca"), task=task, data=run.site_data(), model=run.model, train=run.train,
                            seed=run.seed)
    heads = {}
    for index, site in enumerate(run.site_names):
        (state_file,) = workspace.glob(f"{site}/**/{SITE_STATE_FILE}")
        saved = torch.load(state_file, weights_only=False)
        assert set(saved["private"]) == {"personal_head.weight", "personal_head.bias"}
        heads[site] = saved["private"]["personal_head.weight"]
        restarted = SiteRuntime(settings, site, index, log=lambda m: None, local_dir=state_file.parent)
        restored = restarted.trainer.state_dict()
        for key, value in saved["private"].items():
            assert np.array_equal(restarted.model.state_dict()[key].numpy(), value), (site, key)
            assert np.array_equal(restored["private"][key], value)
        for param, moments in saved["optimizer"]["state"].items():
            for name, tensor in moments.items():
                assert torch.equal(restored["optimizer"]["state"][param][name], tensor), (site, param, name)
        # Not the seeded initial head again: a site without a state file starts from a different one.
        fresh = SiteRuntime(settings, site, index, log=lambda m: None, local_dir=tmp_path / f"empty-{site}")
        assert not np.array_equal(fresh.model.state_dict()["personal_head.weight"].numpy(), heads[site])
    assert not np.array_equal(heads["site-1"], heads["site-2"])  # each site keeps its own head
