"""``stream_aggregation`` through FLARE's simulator: the server learns the train task's sites from FLARE, sums
the results in site order as they arrive, and the job ends with a finite model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medflare.console.simulate import run_simulation
from medflare.plan import resolve
from medflare.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

SITES = 3


def test_a_streamed_job_finishes_with_a_finite_model_and_records_each_round(tmp_path: Path) -> None:
    config = RunConfig(method="fedavg", rounds=2, clients=SITES, data={"source": "synthetic:n=240,classes=3"},
                       train={"max_steps": 2, "batch_size": 16}, stream_aggregation=True)
    run_simulation(resolve(config, "byoc"), tmp_path / "run", echo=lambda line: None)
    rounds = json.loads((tmp_path / "run" / "medflare_results.json").read_text())["rounds"]
    assert len(rounds) == 2
    for record in rounds:
        facts = record["stream_aggregation"]
        assert facts["mode"] == "streamed" and facts["in_site_order"] is True
        # had FLARE's client list not reached the aggregator, every result would wait for the aggregation
        assert facts["most_results_held"] < SITES
        assert set(record["share"]) == {f"site-{i + 1}" for i in range(SITES)}
    assert not (tmp_path / "run" / "stream_aggregation.png").exists()  # a round fact, not a value per site
    final = torch.load(tmp_path / "run" / "FL_global_model.pt", weights_only=False)["model"]
    assert all(torch.isfinite(value).all() for value in final.values() if value.is_floating_point())
