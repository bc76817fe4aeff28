"""The ServerApp and ClientApp of Flower's side: Flower's own FedAvg strategy, and clients doing the shared site work.

Both read the workload file ``benchmarks/peer_flower.py`` writes (path in ``MEDFLARE_PEER_WORKLOAD``): rounds, each
site's :class:`fedavg_site.SiteSpec` and the sha256 of its partition as medflare's data code built it there. A
client builds its site from the spec (``fedavg_site.FedAvgSite``, the bare loop's site), refuses to train when its
partition's digest differs, and keeps Adam's state across rounds in its Flower ``Context.state`` (in the
deployment engine each round's ClientApp is a new process). The server records each round's start and end, every
site's own timings and the bytes each way, and writes them to ``MEDFLARE_PEER_RESULT``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from fedavg_site import FedAvgSite, initial_state, spec_from_dict
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

WORKLOAD_ENV = "MEDFLARE_PEER_WORKLOAD"
RESULT_ENV = "MEDFLARE_PEER_RESULT"
ARRAYS, METRICS, OPTIMIZER = "arrays", "metrics", "optimizer"  # record keys (FedAvg's defaults for the first)
TIMINGS = ("work", "train", "images")  # what FedAvgSite.round reports, sent back as metrics
# when (time.time()) the app module was imported, the client's handler entered and left: where a round goes
STAMPS = ("loaded_at", "entered_at", "left_at")
LOADED_AT = time.time()


def workload() -> dict[str, Any]:
    return json.loads(Path(os.environ[WORKLOAD_ENV]).read_text())


def as_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(array_dict={name: Array(np.ascontiguousarray(value)) for name, value in arrays.items()})


def as_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


# ----- the client ---------------------------------------------------------------------------------------------
client = ClientApp()


@lru_cache(maxsize=None)
def site_for(partition: int) -> FedAvgSite:
    """The site of ``partition``, built once per process (a simulation actor serves many rounds)."""
    load = workload()
    site = FedAvgSite(spec_from_dict(load["sites"][partition]))
    expected = load["digests"][site.spec.name]
    if site.digest() != expected:
        raise RuntimeError(f"{site.spec.name}: partition digest {site.digest()[:12]} differs from the workload "
                           f"file's {expected[:12]}: Flower would not train on medflare's partition")
    return site


@client.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the shared site work; Adam's state travels in the context between rounds."""
    entered_at = time.time()
    site = site_for(int(context.node_config["partition-id"]))
    if OPTIMIZER in context.state:
        site.load_optimizer_state(as_arrays(context.state[OPTIMIZER]))
    state, timing = site.round(as_arrays(msg.content[ARRAYS]))
    context.state[OPTIMIZER] = as_record(site.optimizer_state())
    stamps = {"loaded_at": LOADED_AT, "entered_at": entered_at, "left_at": time.time()}
    metrics = MetricRecord({"num-examples": site.n_train, **{k: float(timing[k]) for k in TIMINGS}, **stamps})
    return Message(RecordDict({ARRAYS: as_record(state), METRICS: metrics}), reply_to=msg)


# ----- the server ---------------------------------------------------------------------------------------------
class TimedFedAvg(FedAvg):
    """Flower's FedAvg unchanged; it notes when each round starts and is aggregated, and what travelled."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.rounds: list[dict[str, Any]] = []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        started = time.time()
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.rounds.append({"round": server_round, "started_at": started,
                            "bytes_down": [m.content[ARRAYS].count_bytes() for m in messages]})
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        good = [r for r in replies if not r.has_error()]
        record = self.rounds[-1]
        record["errors"] = [str(r.error) for r in replies if r.has_error()]
        record["sites"] = [{k: r.content[METRICS][k] for k in TIMINGS + STAMPS} for r in good]
        record["bytes_up"] = [r.content[ARRAYS].count_bytes() for r in good]
        aggregated = super().aggregate_train(server_round, replies)
        record["aggregated_at"] = time.time()
        return aggregated


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    load = workload()
    sites = len(load["sites"])
    strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=sites,
                           min_available_nodes=sites)  # every site every round, as medflare and the bare loop
    initial = as_record(initial_state(spec_from_dict(load["sites"][0])))
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(load["rounds"]))
    Path(os.environ[RESULT_ENV]).write_text(json.dumps({"rounds": strategy.rounds}, indent=1))
