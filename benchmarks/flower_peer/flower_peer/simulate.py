"""Flower's simulation engine on the benchmark's workload: ``python -m flower_peer.simulate`` (in .venv-flower).

One Ray actor per site, all at once (a CPU each; on a CUDA machine they share the GPU), as the bare loop and
medflare's simulator run one process per site.
"""

from __future__ import annotations

import torch
from flwr.simulation import run_simulation

from flower_peer.apps import client, server, workload


def backend_config(sites: int, gpu: bool) -> dict:
    return {"client_resources": {"num_cpus": 1, "num_gpus": 1.0 / sites if gpu else 0.0},
            "init_args": {"num_cpus": sites, "num_gpus": 1 if gpu else 0}}


def main() -> None:
    sites = len(workload()["sites"])
    run_simulation(server_app=server, client_app=client, num_supernodes=sites,
                   backend_config=backend_config(sites, torch.cuda.is_available()))


if __name__ == "__main__":
    main()
