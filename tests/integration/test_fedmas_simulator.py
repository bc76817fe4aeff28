"""Fed-MAS end to end in FLARE's simulator: 3 sites x 2 rounds, RF recorded per site and round."""

from pathlib import Path

import pytest

from medflare.console.simulate import run_simulation
from medflare.plan import resolve
from medflare.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy


def test_fedmas_records_rf_and_rf_weighted_shares(tmp_path: Path) -> None:
    run = RunConfig(
        method="fedmas", rounds=2, clients=3,
        data={"source": "synthetic:n=600,imbalance=10", "partition": "dirichlet:0.5"},
        train={"max_steps": 3, "batch_size": 32}, method_args={"prior_input_size": 32},
    )
    summary = run_simulation(resolve(run, "byoc"), tmp_path / "fedmas", echo=lambda line: None)
    sites = {"site-1", "site-2", "site-3"}
    for entry in summary["per_round"]:
        assert set(entry["rf"]) == sites and all(0 < v <= 1 for v in entry["rf"].values())
        total = sum(entry["rf"].values())
        assert entry["share"] == pytest.approx({s: v / total for s, v in entry["rf"].items()})
    for site in sites:
        assert "rf" in summary["payload"][site]["meta_keys"]
        assert not {"w", "w_hat"} & set(summary["payload"][site]["meta_keys"])
    assert (tmp_path / "fedmas" / "rf.png").is_file()
    assert (tmp_path / "fedmas" / "sites" / "site-1" / "medflare_site_log.jsonl").is_file()
    assert (tmp_path / "fedmas" / "sites" / "site-1" / "diagnostics.png").is_file()
