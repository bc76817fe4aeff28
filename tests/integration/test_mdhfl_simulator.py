"""MDH-FL end to end in FLARE's simulator: four sites with four architectures exchange only probabilities and
scalars (checked on every recorded message), and a site holding another copy of the public set stops the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medflare.console.simulate import SimulationError, run_simulation
from medflare.models import create_model
from medflare.plan import resolve
from medflare.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

PLUGINS = Path(__file__).parent / "plugins"
SITE_MODELS = {"site-1": "resnet10", "site-2": "resnet12", "site-3": "shufflenet", "site-4": "mobilenet_v2"}
K = 3
DATA = {"source": f"synthetic:n=320,classes={K},n_val=40,n_test=40", "partition": "dirichlet:0.5",
        "public_fraction": 0.15, "augment": "none"}


def records(out: Path, site: str, name: str) -> list[dict]:
    path = out / "sites" / site / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_four_architectures_exchange_only_probabilities_and_scalars(tmp_path: Path) -> None:
    run = RunConfig(
        method="mdhfl", rounds=2, clients=4, model="resnet12", site_model=SITE_MODELS,
        data={**DATA, "label_noise": [0.0, 0.1, 0.2, 0.3], "noise_kind": "pairflip"},
        train={"max_steps": 2, "batch_size": 8}, method_args={"chunks": 2, "public_per_round": 16}, audit=True,
    )
    out = tmp_path / "mdhfl"
    summary = run_simulation(resolve(run, "byoc"), out, echo=lambda line: None)

    assert summary["rounds_completed"] == 2
    assert torch.load(out / "FL_global_model.pt", weights_only=False)["model"] == {}  # the server holds no model
    assert set(summary["final"]["by_site"]) == set(SITE_MODELS) and "accuracy" in summary["final"]["site_mean"]
    for entry in summary["per_round"]:
        assert entry["targets_for"] == [sorted(SITE_MODELS)] * 2  # every site got its own T_p for both chunks
    for site, model in SITE_MODELS.items():
        setup = next(r for r in records(out, site, "medflare_site_log.jsonl") if "parameters" in r)
        assert setup["parameters"] == sum(p.numel() for p in create_model(model, K, 3, image_size=28).parameters())
        sent = [r for r in records(out, site, "medflare_payload_audit.jsonl") if r["direction"] == "result"]
        received = [r for r in records(out, site, "medflare_payload_audit.jsonl") if r["direction"] == "task"]
        assert [r["task"] for r in sent].count("public_probs") == 4  # 2 chunks x 2 rounds
        for record in sent:  # no weight tensor ever: one probability matrix at most, 8 rows x K in float16
            if record["task"] == "public_probs":
                assert record["arrays"] == {"probs": ["float16", [8, K]]} and record["bytes"] == 8 * K * 2
            else:
                assert record["arrays"] == {}, record
        for record in received:
            assert set(record["arrays"]) <= {"target", "public_rows"}, record
            if "target" in record["arrays"]:
                assert record["arrays"]["target"] == ["float16", [8, K]]


def test_a_site_with_another_copy_of_the_public_set_stops_the_job(tmp_path: Path) -> None:
    run = RunConfig(
        method="test-mdhfl-truncated-copy", rounds=1, clients=3, data=DATA, train={"max_steps": 1, "batch_size": 8},
        method_args={"public_per_round": 16}, plugins=[str(PLUGINS / "corrupt_public_copy.py")],
    )
    with pytest.raises(SimulationError, match=r"public set mismatch: site-2 hold\(s\) a different copy"):
        run_simulation(resolve(run, "byoc"), tmp_path / "out", echo=lambda line: None)
