"""``medflare predict``: apply a run's global model to new images and write a CSV of class probabilities.

The model file (``FL_global_model.pt`` or ``best_FL_global_model.pt``) carries what inference needs
(``medflare.checkpoint``): the method and model to rebuild, the task (classes, their names, channels, image
size), the normalisation and the intensity window of DICOM/NIfTI data. Images go through the same reader and
evaluation transform as at the sites, and the model scores them with the method's own ``predict_logits`` hook,
so the probabilities are those a site's evaluation computes.

What is refused, with one line saying why: a file without medflare facts; a method whose server holds no model
(``local-only``, MDH-FL: each site keeps its own); a method that keeps part of the model at the sites (a personal
head, FCA): the global file lacks it, and the model the sites score includes it; and input from another task
(another channel count, or labels and class names the model does not know).

Inputs: a folder (every image below it; images in first-level folders named like the model's classes are
labelled by them), a CSV (``path`` column, relative to the CSV; optional ``label`` or ``class_name``), or an npz
(``images``, or MedMNIST's ``<split>_images``; optional labels).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from medflare.checkpoint import Checkpoint, normalization, read_checkpoint
from medflare.data.readers import IMAGE_SUFFIXES, is_image_file, parse_window, read_image
from medflare.data.types import UNLABELED, ImageSet
from medflare.errors import ConfigError, DataError

NPZ_IMAGE_KEYS = ("images",)  # else <split>_images (MedMNIST layout)


@dataclass
class PredictInput:
    """Images to score, with an identifier per image and, when the input says so, their labels.

    Attributes:
        images: the images (files or in memory), labels -1 where unknown.
        ids: one identifier per image (relative path, or ``<file>[<row>]`` for an npz).
        labelled: whether the input gave labels.
    """

    images: ImageSet
    ids: list[str]
    labelled: bool


def predict_file(checkpoint_path: str | Path, input_path: str | Path, output: str | Path, *, split: str = "test",
                 window: str | None = None, batch_size: int = 64) -> dict[str, Any]:
    """Score every image of ``input_path`` with the checkpoint and write ``output`` (CSV); return a summary.

    Args:
        checkpoint_path: a run's FL_global_model.pt or best_FL_global_model.pt.
        input_path: a folder, a .csv manifest or an .npz.
        output: the CSV to write; it must not exist (medflare never replaces a file it did not write).
        split: which ``<split>_images`` of a MedMNIST-layout npz.
        window: intensity window of DICOM/NIfTI input (default: the one the model was trained with).
        batch_size: images per forward pass.

    Raises:
        ConfigError: the checkpoint, the input or the output is unusable (one line saying why and what to do).
    """
    output = Path(output)
    if output.exists():
        raise ConfigError(f"{output} exists; medflare does not replace files: choose a new output file")
    if not output.parent.is_dir():
        raise ConfigError(f"the folder of {output} does not exist; create it or choose another output file")
    checkpoint = read_checkpoint(checkpoint_path)
    logits_of = scorer(checkpoint)
    task = checkpoint.facts["task"]
    chosen_window = checkpoint.facts.get("window", "") if window is None else window
    inputs = read_input(Path(input_path), int(task["in_channels"]), checkpoint.class_names, split, chosen_window)
    probabilities = class_probabilities(logits_of, inputs.images, int(task["image_size"]), batch_size)
    write_predictions(output, inputs, probabilities, checkpoint.class_names)
    return {"images": len(inputs.ids), "output": str(output), "method": checkpoint.facts["method"],
            "model": checkpoint.facts["model"], "class_names": checkpoint.class_names,
            "trained_with": checkpoint.facts.get("medflare_version")}


# ----- the model ---------------------------------------------------------------------------------------
def scorer(checkpoint: Checkpoint) -> Callable[[Any], Any]:
    """The model rebuilt from the checkpoint, as a function images -> logits (the method's ``predict_logits``).

    Raises:
        ConfigError: no global model, part of the model kept at the sites, another architecture, or another
            normalisation than this medflare's.
    """
    import torch

    from medflare.config import from_dict
    from medflare.flare.models import build_global_model
    from medflare.methods.base import LocalTrainer
    from medflare.models import get_device
    from medflare.registry import get_method

    facts, where = checkpoint.facts, checkpoint.path
    if not facts.get("server_model", True) or not checkpoint.weights:
        raise ConfigError(f"{where}: method '{facts['method']}' keeps no global model (each site trains its own "
                          "model and no weights reach the server), so there is nothing to apply; score with a "
                          "site's own model at that site")
    if facts.get("normalization") != normalization():
        raise ConfigError(f"{where} normalises images as {facts.get('normalization')}, this medflare as "
                          f"{normalization()}; use the medflare version {facts.get('medflare_version')} that trained it")
    spec = get_method(facts["method"])
    task = facts["task"]
    if task.get("multi_label"):
        raise ConfigError(f"{where}: a multi-label model (sigmoid per finding); medflare predict writes one softmax "
                          "class per image and would misreport it, so it refuses multi-label models for now")
    network = build_global_model(facts["method"], facts["model"], int(task["num_classes"]), int(task["in_channels"]),
                                 int(task["image_size"]), method_args=facts.get("method_args") or {}).network
    missing, unexpected = network.load_state_dict(dict(checkpoint.weights), strict=False)
    private = [k for k in missing if spec.payload.is_private(k)]
    if private:
        raise ConfigError(f"{where}: method '{facts['method']}' keeps {private[0]} and {len(private) - 1} more "
                          "entries at the sites (a personal part of the model that never reaches the server); the "
                          "model each site scores includes them, so the global file alone cannot be applied")
    if missing or unexpected:
        raise ConfigError(f"{where} does not fit model '{facts['model']}' of method '{facts['method']}' "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]}); the file was changed or saved by "
                          "another medflare version")
    device = get_device()
    network.to(device).eval()
    method_cfg = from_dict(spec.config_cls, facts.get("method_args") or {}, f"method '{facts['method']}'")
    hook = spec.trainer_cls.predict_logits
    if hook is LocalTrainer.predict_logits:
        return lambda images: network(images.to(device))
    # The method scores with its own hook (e.g. LDAM's scaled cosine logits), which reads the model and the
    # method's config; a hook that needs more of a site's state cannot run outside a site.
    holder = object.__new__(spec.trainer_cls)
    holder.model, holder.cfg, holder.device = network, method_cfg, device

    def method_logits(images: torch.Tensor) -> torch.Tensor:
        try:
            return hook(holder, images.to(device))
        except AttributeError as exc:
            raise ConfigError(f"method '{facts['method']}' scores with site state ({exc}); predict cannot apply "
                              "its model outside a site") from exc

    return method_logits


def class_probabilities(logits_of: Callable[[Any], Any], images: ImageSet, image_size: int,
                        batch_size: int) -> np.ndarray:
    """Softmax of the logits of every image, ``[N, K]`` float64, in input order (the sites' evaluation transform)."""
    import torch
    from torch.utils.data import DataLoader

    from medflare.data.site import ImageDataset
    from medflare.data.transforms import build_transform

    dataset = ImageDataset(images, build_transform(images.channels, image_size, train=False))
    rows = []
    with torch.no_grad():
        for batch, _ in DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0):
            rows.append(torch.softmax(logits_of(batch).float(), dim=1).cpu().double().numpy())
    return np.concatenate(rows)


# ----- the input ---------------------------------------------------------------------------------------
def read_input(path: Path, channels: int, class_names: list[str], split: str, window: str) -> PredictInput:
    """The images of a folder, CSV or npz, checked against the model's task (channels, class labels).

    Raises:
        ConfigError: the input is missing or empty, or belongs to another task.
    """
    if path.is_dir():
        ids, paths, labels = _folder_images(path, class_names)
    elif path.suffix.lower() == ".csv" and path.is_file():
        ids, paths, labels = _manifest_images(path, class_names)
    elif path.suffix.lower() == ".npz" and path.is_file():
        return _npz_images(path, channels, len(class_names), split)
    else:
        raise ConfigError(f"predict input {path} is not a folder, a .csv manifest or an .npz file")
    if not paths:
        raise ConfigError(f"predict input {path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    parsed = parse_window(window)
    try:
        found = read_image(paths[0], None, parsed).shape[-1]
    except DataError as exc:
        raise ConfigError(str(exc)) from exc
    _check_channels(found, channels, paths[0])
    labelled = labels is not None
    images = ImageSet(labels=labels if labelled else np.full(len(paths), UNLABELED), num_classes=len(class_names),
                      channels=channels, paths=paths, name=str(path), window=parsed)
    return PredictInput(images, ids, labelled)


def _check_channels(found: int, channels: int, where: object) -> None:
    if found != channels:
        raise ConfigError(f"{where} has {found}-channel images but the model was trained on {channels}-channel "
                          "images: this input belongs to another task; use a model trained on such images")


def _folder_images(root: Path, class_names: list[str]) -> tuple[list[str], list[str], np.ndarray | None]:
    """Every image below ``root`` (sorted); labels when every image sits in a first-level folder named like a class.

    First-level folders of which some are named like the model's classes and some are not are refused (another
    task's classes); folders named like none of them (e.g. one per patient) carry no labels.
    """
    files = sorted(p for p in root.rglob("*") if p.is_file() and is_image_file(p.name))
    ids = [p.relative_to(root).as_posix() for p in files]
    folders = [Path(i).parts[0] if len(Path(i).parts) == 2 else None for i in ids]
    if files and all(folder in class_names for folder in folders):
        return ids, [str(p) for p in files], np.array([class_names.index(f) for f in folders], dtype=np.int64)
    unknown = sorted({f for f in folders if f is not None} - set(class_names))
    if unknown and set(folders) & set(class_names):
        raise ConfigError(f"{root} has class folders {unknown} that the model does not know (its classes: "
                          f"{', '.join(class_names)}): this input belongs to another task")
    return ids, [str(p) for p in files], None


def _manifest_images(manifest: Path, class_names: list[str]) -> tuple[list[str], list[str], np.ndarray | None]:
    """A CSV with a ``path`` column (relative to the CSV); ``label`` or ``class_name`` columns are checked."""
    with manifest.open(newline="", encoding="utf-8-sig") as handle:
        rows = list(csv.DictReader(handle))
    if not rows or "path" not in rows[0]:
        raise ConfigError(f"{manifest} needs a header with a 'path' column and at least one row")
    paths = [str(manifest.parent / row["path"]) if not os.path.isabs(row["path"]) else row["path"] for row in rows]
    missing = next((p for p in paths if not os.path.isfile(p)), None)
    if missing:
        raise ConfigError(f"{manifest}: image file {missing} does not exist; fix the path (relative to the CSV)")
    labels = None
    if "class_name" in rows[0]:
        unknown = sorted({row["class_name"] for row in rows} - set(class_names))
        if unknown:
            raise ConfigError(f"{manifest} names classes {unknown} that the model does not know (its classes: "
                              f"{', '.join(class_names)}): this input belongs to another task")
        labels = np.array([class_names.index(row["class_name"]) for row in rows], dtype=np.int64)
    elif "label" in rows[0]:
        labels = _checked_labels([row["label"] for row in rows], len(class_names), manifest)
    return [row["path"] for row in rows], paths, labels


def _npz_images(path: Path, channels: int, num_classes: int, split: str) -> PredictInput:
    with np.load(path) as archive:
        key = next((k for k in NPZ_IMAGE_KEYS if k in archive.files), f"{split}_images")
        if key not in archive.files:
            raise ConfigError(f"{path} has no 'images' or '{split}_images' array (it has {', '.join(archive.files)})")
        pixels = archive[key]
        label_key = key.replace("images", "labels")
        raw_labels = archive[label_key].reshape(-1) if label_key in archive.files else None
    if pixels.ndim == 3:
        pixels = pixels[..., None]
    if pixels.ndim != 4 or pixels.dtype != np.uint8 or len(pixels) == 0:
        raise ConfigError(f"{path}: {key} is {pixels.dtype} {pixels.shape}; expected uint8 (N, H, W) or (N, H, W, C)")
    _check_channels(pixels.shape[-1], channels, f"{path} ({key})")
    labels = None if raw_labels is None else _checked_labels(list(raw_labels), num_classes, path)
    images = ImageSet(labels=labels if labels is not None else np.full(len(pixels), UNLABELED),
                      num_classes=num_classes, channels=channels, images=pixels, name=str(path))
    return PredictInput(images, [f"{path.name}[{i}]" for i in range(len(pixels))], labels is not None)


def _checked_labels(values: list[Any], num_classes: int, where: Path) -> np.ndarray:
    try:
        labels = np.array([int(v) for v in values], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: labels must be class ids (whole numbers): {exc}") from exc
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ConfigError(f"{where} has label {int(labels.max() if labels.max() >= num_classes else labels.min())}, "
                          f"but the model knows {num_classes} classes (0..{num_classes - 1}): this input belongs to "
                          "another task")
    return labels


# ----- the output --------------------------------------------------------------------------------------
def write_predictions(output: Path, inputs: PredictInput, probabilities: np.ndarray, class_names: list[str]) -> None:
    """``image[,label],predicted,p_<class>...``; written to a temporary name first, so no half file remains."""
    header = ["image"] + (["label"] if inputs.labelled else []) + ["predicted"] + [f"p_{n}" for n in class_names]
    staging = output.with_name(output.name + ".partial")
    with staging.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for i, (image_id, row) in enumerate(zip(inputs.ids, probabilities)):
            label = [class_names[inputs.images.labels[i]]] if inputs.labelled else []
            writer.writerow([image_id, *label, class_names[int(np.argmax(row))], *(f"{p:.9g}" for p in row)])
    os.replace(staging, output)
