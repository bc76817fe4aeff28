"""Helpers of the predict tests (not collected: no ``test_`` prefix): global model files as FLARE's server writes
them, image files, and the probabilities a site computes for the same images."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from medflare.checkpoint import checkpoint_facts, read_checkpoint
from medflare.plan import build_global_model, resolve, task_of, validated
from medflare.registry import get_method
from medflare.run_config import RunConfig
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime


def save_global_model(path: Path, run: RunConfig, seed: int = 3) -> Path:
    """The global model file FLARE's server writes for ``run`` (medflare's persistor), from a seeded model."""
    from nvflare.apis.fl_context import FLContext

    from medflare.flare.persistor import MedflareModelPersistor

    run = validated(run)
    task = task_of(run)
    model = build_global_model(run.method, run.model, task.num_classes, task.in_channels, task.image_size,
                               method_args=run.method_args, seed=seed)
    persistor = MedflareModelPersistor()
    persistor.model, persistor.facts = model, checkpoint_facts(resolve(run, task=task))
    persistor.load_model(FLContext())
    persistor.save_model_file(str(path))
    return path


def write_images_npz(path: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """MedMNIST layout: the images are the test split (train/val: a few images so a site can load it).

    Class ids are stored as MedMNIST does, ``[N, 1]``; multi-label rows ``[N, K]`` as they are.
    """
    rows = labels if labels.ndim == 2 else labels[:, None]
    np.savez(path, test_images=images, test_labels=rows, train_images=images[:4], train_labels=rows[:4],
             val_images=images[:2], val_labels=rows[:2])
    return path


def ten_synthetic_images(tmp_path: Path, source: str = "synthetic:n=200") -> tuple[Path, np.ndarray]:
    from medflare.data import load_source

    test = load_source(source).test
    labels = np.asarray(test.labels[:10])
    return write_images_npz(tmp_path / "new.npz", np.asarray(test.images[:10]), labels), labels


def read_probabilities(path: Path) -> tuple[list[str], np.ndarray]:
    rows = list(csv.reader(path.open()))
    columns = [i for i, name in enumerate(rows[0]) if name.startswith("p_")]
    return rows[0], np.array([[float(row[i]) for i in columns] for row in rows[1:]])


def site_probabilities(run: RunConfig, npz: Path, model_file: Path) -> np.ndarray:
    """What a site computes: its runtime loads the global weights and scores its test split."""
    run = validated(run)
    task = task_of(run)
    settings = SiteSettings(spec=get_method(run.method), task=TaskSpec(task.num_classes, task.in_channels, task.image_size,
                                                             multi_label=task.multi_label),
                            data={"source": f"medmnist:{npz}", "local": True, "min_size": 1}, model=run.model,
                            method_args=run.method_args)
    runtime = SiteRuntime(settings, "site-1", 0, log=lambda line: None)
    weights = read_checkpoint(model_file).weights
    runtime.trainer.receive({k: v.numpy() for k, v in weights.items()})
    return runtime.trainer.predictions("test")[1]
