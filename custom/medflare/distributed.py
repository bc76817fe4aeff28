"""Data-parallel local training for a site with several GPUs: N processes, one update.

The executor's process is rank 0; it spawns ranks 1..N-1 once per job, so each keeps its optimizer state across
rounds. Each rank trains on its ``DistributedSampler`` shard of the same global batch (``train.batch_size`` at any
process count: speed changes, not the optimisation, up to per-rank BatchNorm statistics), gradients all-reduced
before every step; rank 0's weights are the site's update. Averaging hooks sit on the parameters instead of a
``DistributedDataParallel`` wrapper, which calls such as ``model.forward_features`` would bypass and which would
rename the state-dict keys. A site asks for it in ``local/medflare_site.json`` (``"distributed": {"processes":
2}``); on GPU the count is capped by the GPUs FLARE made visible to the job (its ``resource_spec``).
"""

from __future__ import annotations

import socket
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from medflare.errors import ConfigError
from medflare.methods.base import RoundContext
from medflare.site_config import SiteFile, SiteSettings
from medflare.site_runtime import SiteRuntime

Log = Callable[[str], None]


@dataclass
class DistributedConfig:
    """How many local processes a site trains with (1 = single-process), the backend ("auto": nccl on GPU,
    gloo on CPU) and the seed of the shuffling order every rank shares."""

    processes: int = 1
    backend: str = "auto"
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ConfigError(f"distributed.processes must be >= 1, got {self.processes}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"distributed.backend must be auto, gloo or nccl, got '{self.backend}'")

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"


def site_distributed_config(site_config_dir: str | Path | SiteFile) -> DistributedConfig:
    """The site's ``distributed`` block from ``local/medflare_site.json``, at most one process per GPU FLARE made
    visible to the job (CUDA_VISIBLE_DEVICES, from its ``resource_spec``)."""
    config = SiteFile.of(site_config_dir).section("distributed", DistributedConfig)
    if torch.cuda.is_available() and config.processes > torch.cuda.device_count():
        config.processes = max(1, torch.cuda.device_count())
    return config


def enable_data_parallel(runtime: SiteRuntime, rank: int, world_size: int, shuffle_seed: int) -> None:
    """Make one rank's trainer train on its shard (``train_loader`` replaced on this instance, ``batch_size /
    world_size`` per rank) with every trainable gradient all-reduced and averaged by a hook during ``backward()``."""
    trainer = runtime.trainer
    batch_size = trainer.train_cfg.batch_size
    if batch_size % world_size:
        raise ConfigError(f"train.batch_size={batch_size} must be divisible by distributed.processes={world_size}")
    epoch = {"count": 0}

    def sharded_loader(self: Any) -> DataLoader:
        dataset = self.train_dataset()  # the current stage's samples (e.g. only the labelled ones)
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=shuffle_seed, drop_last=False)
        sampler.set_epoch(epoch["count"])
        epoch["count"] += 1  # a new shared order every epoch, as a shuffled single-process loader gives
        per_rank = self.train_cfg.batch_size // world_size  # the current stage's batch size
        return DataLoader(dataset, batch_size=per_rank, sampler=sampler,
                          drop_last=len(sampler) > per_rank, num_workers=self.train_cfg.num_workers)

    trainer.train_loader = types.MethodType(sharded_loader, trainer)
    if world_size > 1:
        for parameter in trainer.model.parameters():
            if parameter.requires_grad:
                parameter.register_hook(_average_across_ranks(world_size))


def _average_across_ranks(world_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad / world_size

    return hook


def _helper_rank(rank: int, world_size: int, init_method: str, backend: str, settings: SiteSettings,
                 site_name: str, site_index: int, shuffle_seed: int, inbox: Any, outbox: Any) -> None:
    """Ranks 1..N-1: build the same site, then train every round rank 0 asks for, until told to stop."""
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        runtime = SiteRuntime(settings, site_name, site_index, log=lambda message: None)
        enable_data_parallel(runtime, rank, world_size, shuffle_seed)
        outbox.put(("ready", rank))
        while True:
            item = inbox.get()
            if item is None:
                break
            params, ctx = item
            runtime.train(params, ctx)
            outbox.put(("done", rank))
    except BaseException as exc:  # rank 0 must hear about it instead of hanging in all_reduce
        outbox.put(("error", f"rank {rank}: {exc!r}"))
        raise
    finally:
        dist.destroy_process_group()


class DataParallelSite:
    """A site that trains with ``config.processes`` processes and answers like a SiteRuntime (rank 0 logs and
    keeps the site's local log in ``local_dir``)."""

    def __init__(self, settings: SiteSettings, site_name: str, site_index: int, config: DistributedConfig,
                 log: Log = print, local_dir: str | Path | None = None) -> None:
        self.world_size = config.processes
        self.log = log
        context = mp.get_context("spawn")
        self._inboxes = [context.Queue() for _ in range(self.world_size - 1)]
        self._outbox = context.Queue()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        backend = config.resolved_backend()
        self._helpers = [
            context.Process(
                target=_helper_rank,
                args=(rank, self.world_size, init_method, backend, settings, site_name, site_index,
                      config.shuffle_seed, self._inboxes[rank - 1], self._outbox),
                daemon=True,
            )
            for rank in range(1, self.world_size)
        ]
        for helper in self._helpers:
            helper.start()
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=self.world_size)
        self.runtime = SiteRuntime(settings, site_name, site_index, log, local_dir=local_dir)
        enable_data_parallel(self.runtime, 0, self.world_size, config.shuffle_seed)
        self._collect("ready")
        log(f"data-parallel training with {self.world_size} processes ({backend})")

    def train(self, params: Mapping[str, np.ndarray], ctx: RoundContext,
              should_abort: Callable[[], bool] = lambda: False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Every rank trains on its shard; rank 0's (identical) weights and meta are the site's update."""
        plain = {k: np.asarray(v) for k, v in params.items()}
        for inbox in self._inboxes:
            inbox.put((plain, ctx))
        arrays, meta = self.runtime.train(plain, ctx)  # no abort mid-round: ranks must take the same steps
        self._collect("done")
        return arrays, meta

    def run_phase(self, phase: str, arrays: Mapping[str, np.ndarray], ctx: RoundContext) -> tuple[dict, dict]:
        return self.runtime.run_phase(phase, arrays, ctx)

    def validate(self, params: Mapping[str, np.ndarray], ctx: RoundContext | None = None) -> dict[str, Any]:
        return self.runtime.validate(params, ctx)

    def shared_weights(self) -> dict[str, np.ndarray]:
        return self.runtime.shared_weights()

    def close(self) -> None:
        """Finish rank 0's state write, stop the helper ranks and leave the process group."""
        self.runtime.close()
        for inbox in self._inboxes:
            inbox.put(None)
        for helper in self._helpers:
            helper.join(timeout=30)
            if helper.is_alive():
                helper.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _collect(self, expected: str) -> None:
        for _ in self._helpers:
            kind, detail = self._outbox.get(timeout=3600)
            if kind == "error":
                self.close()
                raise RuntimeError(f"a data-parallel rank failed: {detail}")
            if kind != expected:
                raise RuntimeError(f"data-parallel rank sent '{kind}', expected '{expected}'")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
