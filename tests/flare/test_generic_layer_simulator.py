"""The generic layer's hooks, proven end to end through FLARE's simulator with test-only plugin methods.

Each test runs a real job (BYOC, the plugin file shipped inside it) and checks what the sites and the server
actually did: per-site tasks, stage counters and key sets, heterogeneous sites with no server model, a
site-declared evaluation, and site state that a restarted site reloads bit for bit.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from medflare.console.simulate import nvflare_command, run_simulation
from medflare.plan import resolve, task_of, validated
from medflare.registry import get_method
from medflare.run_config import RunConfig

from .._plans import write_run_job

pytestmark = pytest.mark.slow

PLUGINS = Path(__file__).parent / "plugins"
SMALL_DATA = {"source": "synthetic:n=240,classes=3", "partition": "iid"}


def site_log(out: Path, site: str) -> list[dict]:
    path = out / "sites" / site / "medflare_site_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.smoke  # multi-phase, per-site tasks
def test_each_site_receives_its_own_array_in_a_per_site_phase(tmp_path: Path) -> None:
    run = RunConfig(
        method="test-exchange", rounds=2, clients=3, data=SMALL_DATA, train={"max_steps": 1, "batch_size": 16},
        plugins=[str(PLUGINS / "exchange.py")],
    )
    summary = run_simulation(resolve(run, "byoc"), tmp_path / "out", echo=lambda line: None)
    assert summary["rounds_completed"] == 2
    for entry in summary["per_round"]:
        sent = entry["target_sums_sent"]  # what the server built for each site
        assert set(sent) == {"site-1", "site-2", "site-3"}
        assert len({round(v, 3) for v in sent.values()}) == 3  # three different arrays, not one broadcast
    for site in ("site-1", "site-2", "site-3"):
        received = {r["round"]: r["target_sum"] for r in site_log(tmp_path / "out", site) if "target_sum" in r}
        for entry in summary["per_round"]:
            assert received[entry["round"] - 1] == pytest.approx(entry["target_sums_sent"][site], rel=1e-5)
    from medflare.models import create_model

    weights = len(create_model("cnn", 3, 1, image_size=28).state_dict())
    for site, sent in summary["payload"].items():  # per round: the "share" phase's probabilities + the weights
        assert sent["arrays"] == weights + 1, site


@pytest.mark.heavy  # make test-heavy
def test_two_stages_change_counters_key_sets_and_scoring(tmp_path: Path) -> None:
    run = RunConfig(
        method="test-staged", rounds=3, clients=2, data=SMALL_DATA, train={"max_steps": 1, "batch_size": 16},
        plugins=[str(PLUGINS / "staged.py")],
    )
    summary = run_simulation(resolve(run, "byoc"), tmp_path / "out", echo=lambda line: None)
    assert summary["rounds_completed"] == 3
    log = site_log(tmp_path / "out", "site-1")
    rounds = [(r["round"], r["stage"], r["stage_round"], r["stage_rounds"], r["scored"]) for r in log if r["event"] == "round"]
    assert rounds == [(0, "warmup", 0, 2, False), (1, "warmup", 1, 2, False), (2, "main", 0, 1, True)]
    received = [set(r["keys"]) for r in log if r["event"] == "receive"]
    warmup, main, final = received[0], received[2], received[3]
    assert any(k.startswith("backbone.0.") for k in warmup)
    assert not any(k.startswith("backbone.0.") for k in main | final)  # stage-excluded keys stop travelling
    assert not any(k.startswith("head.") for k in set().union(*received))  # the private head never arrives
    # Unscored stage: no evaluation of models 0 and 1; the final metrics are there regardless.
    assert [e["metrics"] == {} for e in summary["per_round"]] == [True, False, False]
    final = summary["final"]
    assert final["balanced_accuracy"] is not None and set(final["by_site"]) == {"site-1", "site-2"}
    assert final["site_mean"]["accuracy"] == pytest.approx(
        np.mean([final["by_site"][s]["accuracy"] for s in ("site-1", "site-2")])
    )
    own = final["extra"]["own"]  # the site-declared evaluation, summed and reported like the global one
    assert set(own["by_site"]) == {"site-1", "site-2"} and 0 <= own["test"]["accuracy"] <= 1
    assert own["test"]["accuracy"] != final["accuracy"] or own["by_site"] != final["by_site"]


@pytest.mark.smoke  # no server model
def test_heterogeneous_sites_and_a_server_without_a_model(tmp_path: Path) -> None:
    run = RunConfig(
        method="local-only", rounds=2, clients=3, data=SMALL_DATA, train={"max_steps": 2, "batch_size": 16},
        site_model={"site-2": "mobilenet_v2", "site-3": "shufflenet"},
    )
    summary = run_simulation(resolve(run, "byoc"), tmp_path / "out", echo=lambda line: None)
    assert summary["rounds_completed"] == 2
    checkpoint = torch.load(tmp_path / "out" / "FL_global_model.pt", weights_only=False)
    assert checkpoint["model"] == {}  # the server holds no model
    by_site = summary["final"]["by_site"]
    assert set(by_site) == {"site-1", "site-2", "site-3"}
    assert {site: sent["arrays"] for site, sent in summary["payload"].items()} == {
        "site-1": 0, "site-2": 0, "site-3": 0,
    }  # no array ever left a site


@pytest.mark.heavy  # make test-heavy
def test_site_state_survives_a_restart_bit_for_bit(tmp_path: Path) -> None:
    """Run a job, then start a fresh site runtime on the same job workspace: it reloads the state the site
    saved after its last round (optimizer moments and the private head) exactly."""
    from medflare.site_config import SiteSettings
    from medflare.site_runtime import SITE_STATE_FILE, SiteRuntime

    run = RunConfig(
        method="test-staged", rounds=3, clients=2, data=SMALL_DATA, train={"max_steps": 2, "batch_size": 16},
        plugins=[str(PLUGINS / "staged.py")],
    )
    run = validated(run)
    task = task_of(run)
    job = write_run_job(run, tmp_path / "jobs", task)
    workspace = tmp_path / "ws"
    subprocess.run(
        nvflare_command() + ["simulator", str(job), "-w", str(workspace), "-n", "2", "-t", "2"],
        check=True, capture_output=True, timeout=600,
    )
    state_files = sorted(workspace.glob(f"site-1/**/{SITE_STATE_FILE}"))
    assert len(state_files) == 1
    saved = torch.load(state_files[0], weights_only=False)
    assert saved["optimizer"]["state"] and set(saved["private"]) == {"head.weight", "head.bias"}
    settings = SiteSettings(
        spec=get_method(run.method), task=task, data=run.site_data(), model=run.model, train=run.train, seed=run.seed
    )
    fresh = SiteRuntime(settings, "site-1", 0, log=lambda m: None, local_dir=state_files[0].parent)
    restored = fresh.trainer.state_dict()
    for key, value in saved["private"].items():
        assert np.array_equal(restored["private"][key], value)
        assert np.array_equal(fresh.model.state_dict()[key].numpy(), value)
    for index, moments in saved["optimizer"]["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(restored["optimizer"]["state"][index][name], tensor), (index, name)
    assert restored["stage"] == "main"
