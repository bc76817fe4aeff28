"""``medflare predict``: apply a run's global model to new images and write a CSV of class probabilities.

The model file carries what inference needs (``medflare.checkpoint``: method, model, task, normalisation, intensity
window). Images go through the sites' reader and evaluation transform and the method's own ``predict_logits``, so
the probabilities are a site evaluation's (softmax, or a sigmoid per finding for a multi-label model, ``predicted``
= the findings scored >= :data:`~medflare.metrics.multi_label.THRESHOLD`). Refused, with one line: a file without
medflare facts, a method whose server holds no model or that keeps part of it at the sites (its global file
lacks that part), and input from another task (channels, labels or class names the model does not know).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from medflare.checkpoint import Checkpoint, normalization, read_checkpoint
from medflare.console.files import atomic_write_text
from medflare.data.classes import same_form
from medflare.data.readers import IMAGE_SUFFIXES, is_image_file, parse_window, read_image, window_note
from medflare.data.sources import CSV_CLASS_PREFIX, class_columns, manifest_rows
from medflare.data.types import UNLABELED, ImageSet
from medflare.errors import ConfigError, DataError
from medflare.metrics.multi_label import THRESHOLD

NPZ_IMAGE_KEYS = ("images",)  # else <split>_images (MedMNIST layout)
DEVICES = ("auto", "cpu", "cuda")  # auto: CUDA when torch sees a GPU, as a site's trainer chooses
# What predict reports on labelled input, after the task's headline metric (medflare.evaluation.headline_metric)
REPORTED_METRICS = ("balanced_accuracy", "accuracy", "auc_macro_ovr")
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet evaluates a cell starting so (CSV injection)


@dataclass
class PredictInput:
    """Images to score (labels -1 where unknown), one id each (relative path, or ``<file>[<row>]`` for an npz)."""

    images: ImageSet
    ids: list[str]
    labelled: bool
    note: str = ""  # readers.window_note: a HU window set for PNG/JPEG/TIFF files


def predict_file(checkpoint_path: str | Path, input_path: str | Path, output: str | Path, *, split: str = "test",
                 window: str | None = None, batch_size: int = 64, device: str = "auto",
                 threads: int | None = None) -> dict[str, Any]:
    """Score every image of ``input_path`` (a folder, a .csv manifest or an .npz) and write ``output``, a CSV that
    must not exist yet; a summary, with :func:`label_metrics` when the input gives labels. ``window``: default the
    one the model was trained with. ConfigError (one line) for an unusable checkpoint, input, output or device."""
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
            "trained_with": checkpoint.facts.get("medflare_version"), "device": str(chosen_device), "note": inputs.note,
            **label_metrics(inputs, probabilities, multi_label)}


def choose_device(name: str) -> Any:
    """The torch device of ``--device`` (one of :data:`DEVICES`); ConfigError for cuda where torch sees no GPU."""
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
    """Within this block torch computes with ``threads`` CPU threads (default: a site trainer's, not torch's one per
    core: on busy cores every batch would wait for the slowest thread, 4x slower measured on 2 busy cores)."""
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
    """``labelled`` (images with a label) and ``metrics`` (None without labels): :data:`REPORTED_METRICS`, headline
    first, computed by the sites' evaluation code from the probabilities the CSV holds."""
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
    """The checkpoint's model on ``device`` as images -> logits (the method's ``predict_logits``); ConfigError for
    no global model, a part kept at the sites, another architecture or another normalisation."""
    import torch

    from medflare.methods.base import LocalTrainer
    from medflare.plan import checkpoint_method
    from medflare.server_setup import GlobalNetwork, global_model

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
    network = global_model(GlobalNetwork(spec, method_cfg, facts["model"], int(task["num_classes"]),
                                         int(task["in_channels"]), int(task["image_size"]),
                                         dp_sgd=bool(facts.get("dp_sgd")))).network
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
    """Scores ``[N, K]`` float64 in input order, as a site's evaluation computes them (softmax, or sigmoids)."""
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
    """The images of a folder, CSV or npz; ConfigError when missing, empty or of another task (channels, labels)."""
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
    return PredictInput(images, ids, labelled, window_note(paths, parsed))


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
    A mix of class-named and other folders is refused (another task); a multi-label input carries no labels (a
    folder cannot say which findings an image lacks)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and is_image_file(p.name))
    ids = [p.relative_to(root).as_posix() for p in files]
    if multi_label:
        return ids, [str(p) for p in files], None
    class_names = [same_form(name) for name in class_names]  # a folder a Mac wrote (NFD) names the class too
    folders = [same_form(Path(i).parts[0]) if len(Path(i).parts) == 2 else None for i in ids]
    if files and all(folder in class_names for folder in folders):
        return ids, [str(p) for p in files], np.array([class_names.index(f) for f in folders], dtype=np.int64)
    unknown = sorted({f for f in folders if f is not None} - set(class_names))
    if unknown and set(folders) & set(class_names):
        raise ConfigError(f"{root} has class folders {unknown} that the model does not know (its classes: "
                          f"{', '.join(class_names)}): this input belongs to another task")
    return ids, [str(p) for p in files], None


def _manifest_images(manifest: Path, class_names: list[str],
                     multi_label: bool = False) -> tuple[list[str], list[str], np.ndarray | None]:
    """A CSV with a ``path`` column (relative to the CSV) and optional ``label``, ``class_name`` or, multi-label,
    ``label_<class>`` columns (1, 0, or -1 / empty; all of the classes or none)."""
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
    """``image[,label],predicted,p_<class>...`` (multi-label: ``label_<class>`` columns as a manifest holds them,
    ``predicted`` the ``;``-joined findings), written atomically (:func:`medflare.console.files.atomic_write_text`); names
    pass :func:`spreadsheet_text`. OutputError: disk full or ``output`` appeared meanwhile (nothing is left)."""
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
