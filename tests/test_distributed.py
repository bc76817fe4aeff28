"""A multi-GPU site's data-parallel training, checked on CPU with the gloo backend: 2 processes give the same
weights as 1 process for the same global batches (SGD without momentum, a model without BatchNorm)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from medflare.distributed import DataParallelSite, DistributedConfig, site_distributed_config
from medflare.errors import ConfigError
from medflare.methods.base import RoundContext
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec

TRAIN = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.05, "batch_size": 16, "max_steps": 4, "local_epochs": 1}


def settings() -> SiteSettings:
    return SiteSettings(
        spec=get_method("fedavg"),
        task=TaskSpec(num_classes=5, in_channels=3, image_size=28),
        data={"source": "synthetic:n=200", "partition": "iid", "num_sites": 1, "seed": 0,
              "augment": "none"},  # random augmentation would differ between ranks
        model="vit_micro",  # LayerNorm only: per-rank batches give the full-batch gradient; 8x cheaper than tiny
        train=dict(TRAIN),
        seed=0,
    )


def train_two_rounds(processes: int) -> list[dict[str, np.ndarray]]:
    """[initial weights, after round 1, after round 2]."""
    site = DataParallelSite(settings(), "site-1", 0, DistributedConfig(processes=processes, backend="gloo"),
                            log=lambda message: None)
    try:
        params = site.shared_weights()
        updates = [params]
        for round_index in range(2):
            params, meta = site.train(params, RoundContext(round_index, 2))
            assert meta["n_samples"] > 0
            updates.append(params)
        return updates
    finally:
        site.close()


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_two_gloo_processes_match_one_process() -> None:
    single, parallel = train_two_rounds(1), train_two_rounds(2)
    for round_single, round_parallel in zip(single, parallel):
        assert round_single.keys() == round_parallel.keys()
        for key in round_single:
            np.testing.assert_allclose(round_parallel[key], round_single[key], rtol=1e-4, atol=1e-5, err_msg=key)
    moved = max(float(np.abs(single[-1][k] - single[0][k]).max()) for k in single[0])
    assert moved > 1e-3  # training changed the weights: the match is not between two untouched models


def test_site_config_reads_the_distributed_block(tmp_path: Path) -> None:
    assert site_distributed_config(tmp_path).processes == 1  # no file: ordinary training
    (tmp_path / "medflare_site.json").write_text(
        json.dumps({"data": {"source": "folder:/x"}, "distributed": {"processes": 2, "backend": "gloo"}})
    )
    config = site_distributed_config(tmp_path)
    assert (config.processes, config.resolved_backend()) == (2, "gloo")
    with pytest.raises(ConfigError):
        DistributedConfig(processes=0)
