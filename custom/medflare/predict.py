"""``medflare predict``: apply a run's global model to new images and write a CSV of class probabilities.

The model file (``FL_global_model.pt`` or ``best_FL_global_model.pt``) carries what inference needs
(``medflare.checkpoint``): the method and model to rebuild, the task (classes, their names, channels, image
size), the normalisation and the intensity window of DICOM/NIfTI data. Images go through the same reader and
evaluation transform as at the sites, and the model scores them with the method's own ``predict_logits`` hook,
so the probabilities are those a site's evaluation computes: a softmax over the classes, or for a multi-label
model (several findings per image) a sigmoid per finding, with the findings scored at least
:data:`~medflare.metrics.multi_label.THRESHOLD` (0.5, the threshold of the sites' metrics) as ``predicted``.

What is refused, with one line saying why: a file without medflare facts; a method whose server holds no model
(``local-only``, MDH-FL: each site keeps its own); a method that keeps part of the model at the sites (a personal
head, FCA): the global file lacks it, and the model the sites score includes it; and input from another task
(another channel count, or labels and class names the model does not know).

Inputs: a folder (every image below it; images in first-level folders named like the model's classes are
labelled by them, single-label models only), a CSV (``path`` column, relative to the CSV; optional ``label`` or
``class_name``, or for a multi-label model one ``label_<class>`` column per class holding 1, 0 or -1 / empty), or
an npz (``images``, or MedMNIST's ``<split>_images``; optional labels, ``[N, K]`` 1/0/-1 rows for multi-label).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from medflare.checkpoint import Checkpoint, normalization, read_checkpoint
from medflare.data.readers import IMAGE_SUFFIXES, is_image_file, parse_window, read_image
from medflare.data.sources import CSV_CLASS_PREFIX, class_columns, manifest_rows
from medflare.data.types import UNLABELED, ImageSet
from medflare.errors import ConfigError, DataError
from medflare.files import atomic_write_text
from medflare.metrics.multi_label import THRESHOLD

NPZ_IMAGE_KEYS = ("images",)  # else <split>_images (MedMNIST layout)
DEVICES = ("auto", "cpu", "cuda")  # auto: CUDA when torch sees a GPU, as a site's trainer chooses
# What predict reports on labelled input, after the task's headline metric (medflare.evaluation.headline_metric)
REPORTED_METRICS = ("balanced_accuracy", "accuracy", "auc_macro_ovr")
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet evaluates a cell starting so (CSV injection)


@dataclass
class PredictInput:
    """Images to score, with an identifier per image and, when the input says so, their labels.

    Attributes:
        images: the images (files or in memory), labels -1 where unknown (multi-label: ``[N, K]`` rows).
        ids: one identifier per image (relative path, or ``<file>[<row>]`` for an npz).
        labelled: whether the input gave labels.
    """

    images: ImageSet
    ids: list[str]
    labelled: bool


def predict_file(checkpoint_path: str | Path, input_path: str | Path, output: str | Path, *, split: str = "test",
                 window: str | None = None, batch_size: int = 64, device: str = "auto",
                 threads: int | None = None) -> dict[str, Any]:
    """Score every image of ``input_path`` with the checkpoint and write ``output`` (CSV); return a summary, with the
    metrics of the labelled images when the input gives labels (:func:`label_metrics`).

    Args:
        checkpoint_path: a run's FL_global_model.pt or best_FL_global_model.pt.
        input_path: a folder, a .csv manifest or an .npz.
        output: the CSV to write; it must not exist (medflare never replaces a file it did not write).
        split: which ``<split>_images`` of a MedMNIST-layout npz.
        window: intensity window of DICOM/NIfTI input (default: the one the model was trained with).
        batch_size: images per forward pass.
        device: one of :data:`DEVICES`.
        threads: CPU threads of the forward passes (default: a site trainer's, ``train.torch_threads``).

    Raises:
        ConfigError: the checkpoint, the input, the output or the device is unusable (one line saying why and what
            to do).
    """
    output = Path(output)
    if output.exists() or output.is_symlink():
        raise ConfigError(f"{output} exists; medflare does not replace files: choose a new output file")
    if not output.parent.is_dir():
        raise ConfigError(f"the folder of {output} does not exist; create it or choose another output file")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    checkpoint = read_checkpoint(checkpoint_path)
    chosen_device = choose_device(device)
    logits_of = scorer(checkpoint, chosen_device)
    task = checkpoint.facts["task"]
    multi_label = bool(task.get("multi_label"))
    chosen_window = checkpoint.facts.get("window", "") if window is None else window
    inputs = read_input(Path(input_path), int(task["in_channels"]), checkpoint.class_names, split, chosen_window,
                        multi_label=multi_label)
    with torch_threads(threads):
        probabilities = class_probabilities(logits_of, inputs.images, int(task["image_size"]), batch_size,
                                            multi_label=multi_label)
    write_predictions(output, inputs, probabilities, checkpoint.class_names, multi_label=multi_label)
    return {"images": len(inputs.ids), "output": str(output), "method": checkpoint.facts["method"],
            "model": checkpoint.facts["model"], "class_names": checkpoint.class_names, "multi_label": multi_label,
            "trained_with": checkpoint.facts.get("medflare_version"), "device": str(chosen_device),
            **label_metrics(inputs, probabilities, multi_label)}


def choose_device(name: str) -> Any:
    """The torch device of ``--device``: auto (CUDA when torch sees a GPU, else the CPU), cpu or cuda.

    Raises:
        ConfigError: an unknown name, or cuda where torch sees no GPU.
    """
    import torch

    from medflare.models import get_device

    if name not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got '{name}'")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA GPU here (no GPU, driver or CUDA build of torch); "
                          "use --device cpu or auto")
    return get_device() if name == "auto" else torch.device(name)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Within this block torch computes with ``threads`` CPU threads (default: a site trainer's), as before after.

    Why a site trainer's count and not torch's (one per core): on a machine where other work holds the cores, more
    threads than free cores make every batch wait for the slowest thread (on 2 busy cores, 4000 28-px images took
    4x longer with torch's 2 threads than with 1).
    """
    import torch

    from medflare.methods.base import TrainConfig

    count = TrainConfig.torch_threads if threads is None else threads
    if count < 1:
        raise ConfigError(f"--threads must be >= 1, got {count}")
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def label_metrics(inputs: PredictInput, probabilities: np.ndarray, multi_label: bool) -> dict[str, Any]:
    """``labelled`` (images with a label; multi-label: with a known finding) and ``metrics`` (None without labels):
    :data:`REPORTED_METRICS`, the task's headline metric first, computed by the sites' own evaluation code from the
    same probabilities the CSV holds."""
    if not inputs.labelled:
        return {"labelled": 0, "metrics": None}
    from medflare.evaluation import headline_metric
    from medflare.methods.base import eval_stats
    from medflare.metrics import compute_metrics

    labels = np.asarray(inputs.images.labels)
    stats = eval_stats(labels, probabilities, np.zeros(len(labels)), num_classes=probabilities.shape[1])
    computed = compute_metrics(stats)
    first = headline_metric(multi_label)
    order = [first, *(key for key in REPORTED_METRICS if key != first)]
    return {"labelled": int(stats.count), "metrics": {key: computed[key] for key in order}}


# ----- the model ---------------------------------------------------------------------------------------
def scorer(checkpoint: Checkpoint, device: Any) -> Callable[[Any], Any]:
    """The model rebuilt from the checkpoint on ``device``, as a function images -> logits (the method's
    ``predict_logits``).

    Raises:
        ConfigError: no global model, part of the model kept at the sites, another architecture, or another
            normalisation than this medflare's.
    """
    import torch

    from medflare.methods.base import LocalTrainer
    from medflare.plan import checkpoint_method
    from medflare.server_setup import global_model

    facts, where = checkpoint.facts, checkpoint.path
    if not facts.get("server_model", True) or not checkpoint.weights:
        raise ConfigError(f"{where}: method '{facts['method']}' keeps no global model (each site trains its own "
                          "model and no weights reach the server), so there is nothing to apply; score with a "
                          "site's own model at that site")
    if facts.get("normalization") != normalization():
        raise ConfigError(f"{where} normalises images as {facts.get('normalization')}, this medflare as "
                          f"{normalization()}; use the medflare version {facts.get('medflare_version')} that trained it")
    spec, method_cfg = checkpoint_method(facts)
    task = facts["task"]
    network = global_model(spec, asdict(method_cfg), facts["model"], int(task["num_classes"]),
                           int(task["in_channels"]), int(task["image_size"]), dp_sgd=bool(facts.get("dp_sgd"))).network
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
    network.to(device).eval()
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


def class_probabilities(logits_of: Callable[[Any], Any], images: ImageSet, image_size: int, batch_size: int, *,
                        multi_label: bool = False) -> np.ndarray:
    """Scores of every image, ``[N, K]`` float64, in input order (the sites' evaluation transform).

    A softmax over the classes, or for a multi-label model a sigmoid per class, as a site's evaluation scores.
    """
    import torch
    from torch.utils.data import DataLoader

    from medflare.data.site import ImageDataset
    from medflare.data.transforms import build_transform

    dataset = ImageDataset(images, build_transform(images.channels, image_size, train=False))
    activation = torch.sigmoid if multi_label else (lambda logits: torch.softmax(logits, dim=1))
    rows = []
    with torch.no_grad():
        for batch, _ in DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0):
            rows.append(activation(logits_of(batch).float()).cpu().double().numpy())
    return np.concatenate(rows)


# ----- the input ---------------------------------------------------------------------------------------
def read_input(path: Path, channels: int, class_names: list[str], split: str, window: str, *,
               multi_label: bool = False) -> PredictInput:
    """The images of a folder, CSV or npz, checked against the model's task (channels, class labels).

    Raises:
        ConfigError: the input is missing or empty, or belongs to another task.
    """
    if path.is_dir():
        ids, paths, labels = _folder_images(path, class_names, multi_label)
    elif path.suffix.lower() == ".csv" and path.is_file():
        ids, paths, labels = _manifest_images(path, class_names, multi_label)
    elif path.suffix.lower() == ".npz" and path.is_file():
        return _npz_images(path, channels, len(class_names), split, multi_label)
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
    images = ImageSet(labels=labels if labelled else _unknown_labels(len(paths), len(class_names), multi_label),
                      num_classes=len(class_names), channels=channels, paths=paths, name=str(path), window=parsed)
    return PredictInput(images, ids, labelled)


def _unknown_labels(count: int, num_classes: int, multi_label: bool) -> np.ndarray:
    """Labels of an input that gave none: -1 per image, or per entry of a multi-label row."""
    return np.full((count, num_classes) if multi_label else count, UNLABELED, dtype=np.int64)


def _check_channels(found: int, channels: int, where: object) -> None:
    if found != channels:
        raise ConfigError(f"{where} has {found}-channel images but the model was trained on {channels}-channel "
                          "images: this input belongs to another task; use a model trained on such images")


def _folder_images(root: Path, class_names: list[str],
                   multi_label: bool = False) -> tuple[list[str], list[str], np.ndarray | None]:
    """Every image below ``root`` (sorted); labels when every image sits in a first-level folder named like a class.

    First-level folders of which some are named like the model's classes and some are not are refused (another
    task's classes); folders named like none of them (e.g. one per patient) carry no labels. A folder cannot say
    which findings an image lacks, so a multi-label model's folder input carries no labels.
    """
    files = sorted(p for p in root.rglob("*") if p.is_file() and is_image_file(p.name))
    ids = [p.relative_to(root).as_posix() for p in files]
    if multi_label:
        return ids, [str(p) for p in files], None
    folders = [Path(i).parts[0] if len(Path(i).parts) == 2 else None for i in ids]
    if files and all(folder in class_names for folder in folders):
        return ids, [str(p) for p in files], np.array([class_names.index(f) for f in folders], dtype=np.int64)
    unknown = sorted({f for f in folders if f is not None} - set(class_names))
    if unknown and set(folders) & set(class_names):
        raise ConfigError(f"{root} has class folders {unknown} that the model does not know (its classes: "
                          f"{', '.join(class_names)}): this input belongs to another task")
    return ids, [str(p) for p in files], None


def _manifest_images(manifest: Path, class_names: list[str],
                     multi_label: bool = False) -> tuple[list[str], list[str], np.ndarray | None]:
    """A CSV with a ``path`` column (relative to the CSV); ``label`` or ``class_name`` columns are checked.

    A multi-label model reads ``label_<class>`` columns instead (1, 0, or -1 / empty), all of its classes or none.
    """
    rows = list(manifest_rows(manifest))
    if not rows or "path" not in rows[0]:
        raise ConfigError(f"{manifest} needs a header with a 'path' column and at least one row")
    paths = [str(manifest.parent / row["path"]) if not os.path.isabs(row["path"]) else row["path"] for row in rows]
    missing = next((p for p in paths if not os.path.isfile(p)), None)
    if missing:
        raise ConfigError(f"{manifest}: image file {missing} does not exist; fix the path (relative to the CSV)")
    labels = None
    if multi_label:
        labels = _multi_hot_rows(rows, class_names, manifest)
    elif "class_name" in rows[0]:
        unknown = sorted({row["class_name"] for row in rows} - set(class_names))
        if unknown:
            raise ConfigError(f"{manifest} names classes {unknown} that the model does not know (its classes: "
                              f"{', '.join(class_names)}): this input belongs to another task")
        labels = np.array([class_names.index(row["class_name"]) for row in rows], dtype=np.int64)
    elif "label" in rows[0]:
        labels = _checked_labels([row["label"] for row in rows], len(class_names), manifest)
    return [row["path"] for row in rows], paths, labels


def _multi_hot_rows(rows: list[dict[str, str]], class_names: list[str], manifest: Path) -> np.ndarray | None:
    """The ``label_<class>`` columns of a manifest as ``[N, K]`` rows of 1/0/-1, or None when it has none."""
    columns = class_columns(list(rows[0]))
    if not columns:
        return None
    expected = [CSV_CLASS_PREFIX + name for name in class_names]
    if sorted(columns) != sorted(expected):
        unknown = sorted(set(columns) - set(expected)) or sorted(set(expected) - set(columns))
        raise ConfigError(f"{manifest} has label columns {columns}, but the model's findings are {', '.join(class_names)} "
                          f"(mismatch: {unknown}): give one {CSV_CLASS_PREFIX}<class> column per finding, or none")
    try:  # empty = not annotated, as in a training manifest
        values = np.array([[int(row[c] or UNLABELED) for c in expected] for row in rows], dtype=np.int64)
    except ValueError as exc:
        raise ConfigError(f"{manifest}: label columns must hold 1, 0, or -1 / empty for not annotated: {exc}") from exc
    return _checked_multi_hot(values, len(class_names), str(manifest))


def _npz_images(path: Path, channels: int, num_classes: int, split: str, multi_label: bool = False) -> PredictInput:
    with np.load(path) as archive:
        key = next((k for k in NPZ_IMAGE_KEYS if k in archive.files), f"{split}_images")
        if key not in archive.files:
            raise ConfigError(f"{path} has no 'images' or '{split}_images' array (it has {', '.join(archive.files)})")
        pixels = archive[key]
        label_key = key.replace("images", "labels")
        raw_labels = archive[label_key] if label_key in archive.files else None
    if pixels.ndim == 3:
        pixels = pixels[..., None]
    if pixels.ndim != 4 or pixels.dtype != np.uint8 or len(pixels) == 0:
        raise ConfigError(f"{path}: {key} is {pixels.dtype} {pixels.shape}; expected uint8 (N, H, W) or (N, H, W, C)")
    _check_channels(pixels.shape[-1], channels, f"{path} ({key})")
    if raw_labels is None:
        labels = None
    elif multi_label:
        labels = _checked_multi_hot(raw_labels, num_classes, f"{path} ({label_key})")
    else:
        labels = _checked_labels(list(raw_labels.reshape(-1)), num_classes, path)
    images = ImageSet(labels=labels if labels is not None else _unknown_labels(len(pixels), num_classes, multi_label),
                      num_classes=num_classes, channels=channels, images=pixels, name=str(path))
    return PredictInput(images, [f"{path.name}[{i}]" for i in range(len(pixels))], labels is not None)


def _checked_multi_hot(values: np.ndarray, num_classes: int, where: str) -> np.ndarray:
    """``[N, K]`` label rows of 1, 0 or -1 (not annotated), K the model's number of findings."""
    if values.ndim != 2 or values.shape[1] != num_classes:
        raise ConfigError(f"{where} is {values.shape}, but the model scores {num_classes} findings per image: give "
                          f"[N, {num_classes}] rows of 1, 0 or -1, or no labels; otherwise this input belongs to "
                          "another task")
    if not np.isin(values, (UNLABELED, 0, 1)).all():
        raise ConfigError(f"{where} holds entries other than 1, 0 and -1 (not annotated); fix the labels")
    return values.astype(np.int64)


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
def write_predictions(output: Path, inputs: PredictInput, probabilities: np.ndarray, class_names: list[str], *,
                      multi_label: bool = False) -> None:
    """``image[,label],predicted,p_<class>...``, written atomically (:func:`medflare.files.atomic_write_text`):
    complete or not at all, never through a symlink, never over a file that appeared meanwhile.

    Multi-label: ``image[,label_<class>...],predicted,p_<class>...``, the label columns as a multi-label manifest
    holds them (1, 0, empty for not annotated) and ``predicted`` the findings scored at least THRESHOLD, joined
    by ``;`` (empty when none is). Image and class names are :func:`spreadsheet_text`; the numbers are as computed.

    Raises:
        OutputError: the disk is full, or ``output`` appeared meanwhile; nothing is left behind.
    """
    names = [spreadsheet_text(n) for n in class_names]  # file and class names come from the input: untrusted
    label_header = [CSV_CLASS_PREFIX + n for n in names] if multi_label else ["label"]
    header = ["image"] + (label_header if inputs.labelled else []) + ["predicted"] + [f"p_{n}" for n in names]
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(header)
    for i, (image_id, row) in enumerate(zip(inputs.ids, probabilities)):
        label = _label_cells(inputs.images.labels[i], names, multi_label) if inputs.labelled else []
        writer.writerow([spreadsheet_text(image_id), *label, _predicted(row, names, multi_label),
                         *(f"{p:.9g}" for p in row)])
    atomic_write_text(output, text.getvalue(), replace=False)


def spreadsheet_text(cell: str) -> str:
    """A text cell a spreadsheet shows as text: one starting like a formula gets a leading ``'`` (OWASP's advice
    against CSV injection). Only text cells pass here, so negative numbers stay numbers."""
    return "'" + cell if cell.startswith(FORMULA_STARTS) else cell


def _label_cells(label: np.ndarray, class_names: list[str], multi_label: bool) -> list[str]:
    """One image's label as written: its class name, or per finding 1 / 0 / empty (not annotated)."""
    if multi_label:
        return ["" if entry == UNLABELED else str(int(entry)) for entry in label]
    return [class_names[int(label)]]


def _predicted(scores: np.ndarray, class_names: list[str], multi_label: bool) -> str:
    """The most probable class, or the findings scored at least THRESHOLD (``;``-joined)."""
    if multi_label:
        return ";".join(name for name, score in zip(class_names, scores) if score >= THRESHOLD)
    return class_names[int(np.argmax(scores))]
