"""One FedAvg site's local work, the same on every side of the framework benchmarks.

The bare PyTorch loop (``overhead.py``) and Flower's client (``flower_peer/``) both run :class:`FedAvgSite`, so
they train the same model on the same partition with the same optimizer steps and score the same splits:
per round, load the received weights, score val and test, train one local epoch (or ``steps`` optimizer steps,
Adam lr 1e-3), return the weights and the site's own timings. medflare's trainer does the same work inside FLARE.

This file imports only torch, numpy and medflare's data and model code (both torch-only, no FLARE), so it also
runs in Flower's own virtual environment, with ``custom/`` and ``benchmarks/`` on ``PYTHONPATH``. A site's data
comes from medflare's ``make_site_data`` with the job's data config (:class:`SiteSpec`, written to a JSON file
for the side that cannot build a RunConfig); :meth:`FedAvgSite.digest` fingerprints the partition so each side
can prove it trained on the same images.

On a CUDA machine a site trains on the GPU as medflare's does: channels_last model, autocast with a gradient
scaler (AMP). Elsewhere it keeps one torch thread, as medflare gives each site (``train.torch_threads``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from medflare.plan import task_of

EVAL_BATCH = 256
ADAM_LR = 1e-3


@dataclass(frozen=True)
class SiteSpec:
    """Everything one site needs to build its data, model and optimizer; JSON-able (``dataclasses.asdict``)."""

    index: int
    name: str
    data: dict[str, Any]  # medflare DataConfig fields, num_classes included
    model: str
    num_classes: int
    in_channels: int
    image_size: int
    seed: int
    batch_size: int
    steps: int  # optimizer steps per round; 0 = one local epoch
    lr: float = ADAM_LR


def site_specs(run: Any, steps: int) -> list[SiteSpec]:
    """Each site's spec for a medflare RunConfig: the data config its sites receive, its model and batch size."""
    task = task_of(run)
    data = {**run.site_data(), "num_classes": task.num_classes}
    batch = int(run.train.get("batch_size", 64))
    return [SiteSpec(index, name, data, run.model, task.num_classes, task.in_channels, task.image_size, run.seed,
                     batch, steps) for index, name in enumerate(run.site_names)]


def spec_from_dict(fields: dict[str, Any]) -> SiteSpec:
    """A spec read back from JSON."""
    return SiteSpec(**{f.name: fields[f.name] for f in dataclasses.fields(SiteSpec)})


def build_model(spec: SiteSpec) -> torch.nn.Module:
    from medflare.models import create_model

    return create_model(spec.model, spec.num_classes, spec.in_channels, image_size=spec.image_size)


def initial_state(spec: SiteSpec) -> dict[str, np.ndarray]:
    """The global model every side starts from: the model built right after seeding torch with the job's seed."""
    torch.manual_seed(spec.seed)
    return to_numpy(build_model(spec).state_dict())


def to_numpy(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """CPU copies in the standard (contiguous) layout, whatever device and memory format the model uses."""
    return {k: v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True).numpy()
            for k, v in state.items()}


def site_data(spec: SiteSpec) -> Any:
    """The site's medflare ``SiteData``: what ``make_site_data`` builds for it from the job's data config."""
    from medflare.data import DataConfig, make_site_data

    return make_site_data(DataConfig(**spec.data), spec.index, spec.name)


def partition_digest(data: Any) -> str:
    """sha256 of a site's train, val and test images and labels: equal digests, equal partitions."""
    hasher = hashlib.sha256()
    for split in (data.train, data.val, data.test):
        images = split.images  # the split's ImageSet
        hasher.update(np.ascontiguousarray(images.labels).tobytes())
        if images.images is not None:
            hasher.update(np.ascontiguousarray(images.images).tobytes())
        else:
            hasher.update("\n".join(images.paths or []).encode())
    return hasher.hexdigest()


class FedAvgSite:
    """One site: its data, model and Adam optimizer, kept across rounds."""

    def __init__(self, spec: SiteSpec) -> None:
        from medflare.models import get_device, place_model

        self.device = get_device()
        self.amp = self.device.type == "cuda"
        if not self.amp:
            torch.set_num_threads(1)  # what medflare gives each site on CPU
        self.spec = spec
        self.data = site_data(spec)
        torch.manual_seed(spec.seed + spec.index)
        self.model = place_model(build_model(spec), self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=spec.lr)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp else None

    @property
    def n_train(self) -> int:
        """Training samples: the site's FedAvg weight."""
        return len(self.data.train)

    def digest(self) -> str:
        """:func:`partition_digest` of this site's data."""
        return partition_digest(self.data)

    def round(self, params: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Load ``params``, score val and test, train; the new weights and the seconds of work and training."""
        started = time.perf_counter()
        self.model.load_state_dict({k: torch.as_tensor(v) for k, v in params.items()})
        self.evaluate()
        train_started = time.perf_counter()
        images_seen = self.train()
        if self.amp:
            torch.cuda.synchronize()
        train_seconds = time.perf_counter() - train_started
        state = to_numpy(self.model.state_dict())
        return state, {"work": time.perf_counter() - started, "train": train_seconds, "images": images_seen}

    def evaluate(self) -> None:
        """Score the received model on val and test (softmax scores, as medflare's sites compute each round)."""
        self.model.eval()
        with torch.no_grad(), torch.autocast(self.device.type, enabled=self.amp):
            for split in (self.data.val, self.data.test):
                for images, _ in DataLoader(split, batch_size=EVAL_BATCH, pin_memory=self.amp):
                    torch.softmax(self.model(images.to(self.device, non_blocking=True)), dim=1)

    def train(self) -> int:
        """One local epoch (full batches when that leaves one), capped at ``steps``; the images trained on."""
        self.model.train()
        images_seen, batch, steps = 0, self.spec.batch_size, self.spec.steps
        loader = DataLoader(self.data.train, batch_size=batch, shuffle=True, drop_last=self.n_train > batch,
                            pin_memory=self.amp)  # on CUDA as medflare's trainer loads its batches
        for step, (images, labels) in enumerate(loader):
            if steps and step >= steps:
                break
            images, labels = images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            self.optimizer.zero_grad()
            with torch.autocast(self.device.type, enabled=self.amp):
                loss = F.cross_entropy(self.model(images), labels)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()
            images_seen += len(labels)
        return images_seen

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """Adam's per-parameter state as flat arrays ("<param>.<name>"), for a client that lives one round."""
        state = self.optimizer.state_dict()["state"]
        return {f"{index}.{name}": value.detach().cpu().numpy() for index, entry in state.items()
                for name, value in entry.items()}

    def load_optimizer_state(self, flat: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`optimizer_state` returned (the hyper-parameters are this optimizer's own)."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in flat.items():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = torch.as_tensor(value)
        self.optimizer.load_state_dict({"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]})
