"""`load_source`: turns a source spec string into train/val/test `ImageSet`s.

Spec forms:
    synthetic[:key=val,...]   embedded generator (see `medflare.data.synthetic.SyntheticConfig` for the keys)
    medmnist:PATH             a MedMNIST .npz (train/val/test images and labels; any size, 1 or 3 channels;
                              optional <split>_attributes, one integer per image); `(N, K)` 0/1 labels with
                              K > 1 (e.g. ChestMNIST) load as multi-label
    folder:DIR                DIR/<class>/<images> or DIR/{train,val,test}/<class>/<images>; the images may lie in
                              subfolders, DIR/<class>/<patient>/<images> (e.g. one DICOM series per patient)
    csv:FILE                  manifest with header path,label[,site][,attribute][,split][,class_name][,patient_id];
                              a multi-label manifest has one column per class, label_<name>, holding 1, 0, or
                              -1 / empty for "not annotated", instead of `label`

Without explicit splits a seeded stratified 70/15/15 split is made that keeps every patient's images in one split
(`grouped_split`): the patient is a DICOM's PatientID (or StudyInstanceUID), else the folder below the class folder,
or a CSV's patient_id column (else its DICOMs' headers); `info["grouping"]` records the key and the patients per
split. Class names come from the data where it has them (`info["named_classes"]`), else `class_<k>`. Results are
cached in-process with read-only arrays.
"""

from __future__ import annotations

import codecs
import collections
import csv
import dataclasses
import functools
import io
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from medflare.data.classes import same_form
from medflare.data.partition import multi_label_strata
from medflare.data.plugins import plugin_loader, source_kinds
from medflare.data.readers import DICOM_SUFFIXES, IMAGE_SUFFIXES, PIL_SUFFIXES, dicom_patient, is_image_file, read_image
from medflare.data.synthetic import SyntheticConfig, make_synthetic
from medflare.data.types import UNLABELED, DataSplits, ImageSet, labelled_counts
from medflare.errors import ConfigError, DataError, did_you_mean

SOURCE_FORMS = ("synthetic", "synthetic:key=val,...", "medmnist:PATH", "folder:DIR", "csv:FILE")
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.70, 0.15, 0.15)
SHAPE_PROBES = 200  # image headers read to tell a source of mixed or non-square sizes (probe_shapes)
CSV_REQUIRED = ("path", "label")
CSV_CLASS_PREFIX = "label_"  # multi-label manifests: one column label_<class name> per class
PATIENT_COLUMN = "patient_id"  # a CSV manifest's patient (or study) column: a patient's rows share one split
CSV_OPTIONAL = ("site", "attribute", "split", "class_name", PATIENT_COLUMN)
PATIENT_FOLDER = "folder <class>/<patient>/"  # the patient key of images in subfolders of their class folder
GROUP_FOLDS = 20  # StratifiedGroupKFold folds: 14 train / 3 val / 3 test are 70/15/15 in whole patients
MIN_GROUPS = 3  # one patient per split at least; with fewer the images are split one by one (a note says so)
# The spec forms whose argument names a file or folder (see `absolute_source`), and which of the two it must be
PATH_SOURCES = {"medmnist": "file", "folder": "dir", "csv": "file"}
# Simulated sites may run as threads of one process: load each source once instead of racing to build it.
_LOAD_LOCK = threading.Lock()
_LOG = logging.getLogger(__name__)


def load_source(spec: str, *, seed: int = 0, num_classes: int | None = None, left_out: Iterable[str] = (),
                patient_column: str = "") -> DataSplits:
    """Loads (or generates) a data source as train/val/test splits plus `info` (class_names, channels,
    image_size, counts, grouping, ...); the same object for repeated calls in one process. `seed` seeds the
    synthetic generator and the automatic split; `num_classes` is checked against the data. `left_out`: class names
    (a site's ``class_map`` nulls) whose images a folder or CSV source skips unread; `info["left_out"]` counts them.
    `patient_column` names a CSV manifest's patient column ("": `PATIENT_COLUMN`, when the manifest has it).

    Raises:
        ConfigError: Unknown spec form or bad synthetic options.
        DataError: Missing path, unreadable data, labels outside [0, C), or a class count that disagrees with
            `num_classes`.
    """
    with _LOAD_LOCK:
        return _load_source_cached(spec.strip(), int(seed), None if num_classes is None else int(num_classes),
                                   tuple(sorted({same_form(name) for name in left_out})), patient_column.strip())


def absolute_source(spec: str, option: str = "data.source", check: bool = True) -> str:
    """``spec`` with the file or folder it names (also a plugin's argument that names one here) made absolute
    against the current folder: FLARE runs every party in a workspace of its own, where a relative path would
    fail at every site. With ``check``, DataError (naming ``option``) when it names nothing here."""
    kind, _, path = spec.strip().partition(":")
    if kind not in PATH_SOURCES and path and not os.path.isabs(path) and os.path.exists(os.path.expanduser(path)):
        # a plugin's argument that names a file or folder here: the plugin reads it from the site's folder
        return f"{kind}:{os.path.abspath(os.path.expanduser(path))}"
    if kind not in PATH_SOURCES or not path:
        return spec  # generated data, or a spec load_source refuses with its own message
    return f"{kind}:{absolute_path(path, PATH_SOURCES[kind], option, check)}"


def absolute_path(path: str, kind: str, option: str, check: bool = True) -> str:
    """``path`` (``~`` expanded) made absolute against the current folder; with ``check``, DataError when it
    names no ``kind`` ("file" or "dir") here."""
    absolute = os.path.abspath(os.path.expanduser(path))
    exists = os.path.isdir(absolute) if kind == "dir" else os.path.isfile(absolute)
    if check and not exists:
        where = "" if os.path.isabs(os.path.expanduser(path)) else \
            f" (a relative path is read from the folder medflare runs in, {os.getcwd()}: {absolute})"
        raise DataError(f"{option}: {'folder' if kind == 'dir' else 'file'} '{path}' does not exist{where}; "
                        "fix the path")
    return absolute


def clear_source_cache() -> None:
    """Forgets every cached `load_source` result (e.g. after files of a folder/CSV source changed)."""
    with _LOAD_LOCK:
        _load_source_cached.cache_clear()


def _source_hint(spec: str, kinds: Iterable[str]) -> str:
    """' (did you mean ...?)' for a source that is a path without its kind (a folder, a .csv or .npz file) or a
    misspelt one of ``kinds``; "" otherwise."""
    kind, sep, argument = spec.partition(":")
    path = Path(spec)
    if path.is_dir():
        return f" (did you mean 'folder:{spec}'?)"
    if path.suffix.lower() in (".csv", ".npz") and not sep:
        return f" (did you mean '{'csv' if path.suffix.lower() == '.csv' else 'medmnist'}:{spec}'?)"
    return did_you_mean(kind, kinds, lambda close: f"{close}:{argument}") if sep else ""


@functools.lru_cache(maxsize=8)
def _load_source_cached(spec: str, seed: int, num_classes: int | None, left_out: tuple[str, ...] = (),
                        patient_column: str = "") -> DataSplits:
    kind, _, argument = spec.partition(":")
    loaders: dict[str, Callable[[str, int, int | None], DataSplits]] = {
        "synthetic": _load_synthetic,
        "medmnist": _load_medmnist,
        "folder": _load_folder,
        "csv": functools.partial(_load_csv, patient_column=patient_column or PATIENT_COLUMN),
    }
    loader = loaders.get(kind) or plugin_loader(kind)  # a plugin's own kind (medflare.data.plugins)
    if loader is None or (kind in loaders and kind != "synthetic" and not argument):
        plugins = [f"{name}:..." for name in source_kinds()]
        raise ConfigError(f"Unknown data source '{spec}'{_source_hint(spec, [*loaders, *source_kinds()])}; valid forms: "
                          f"{', '.join([*SOURCE_FORMS, *plugins])}.")
    if patient_column and kind != "csv":
        raise ConfigError(f"data.patient_column='{patient_column}' names a CSV manifest's column, but the source "
                          f"'{spec}' is not a CSV; remove data.patient_column (a folder source finds patients in "
                          "<class>/<patient>/ folders or the DICOMs' PatientID).")
    if left_out and kind in ("folder", "csv"):  # they name their classes before reading an image
        loader = functools.partial(loader, left_out=left_out)
    splits = loader(argument, seed, num_classes)
    splits.info = _describe(splits, spec, kind) | splits.info
    for image_set in (splits.train, splits.val, splits.test):
        _freeze(image_set)
    return splits


def _load_synthetic(options: str, seed: int, num_classes: int | None) -> DataSplits:
    config = SyntheticConfig.from_spec(options)
    if num_classes is not None and config.classes != num_classes:
        raise DataError(
            f"Source 'synthetic{':' if options else ''}{options}' generates classes={config.classes} but "
            f"num_classes={num_classes} is declared; add classes={num_classes} to the synthetic spec "
            f"(e.g. 'synthetic:classes={num_classes}') or fix num_classes."
        )
    return make_synthetic(config, seed)


def _load_medmnist(path: str, seed: int, num_classes: int | None) -> DataSplits:
    del seed  # MedMNIST ships its own split
    _require_path(path, "MedMNIST file", "file")
    try:
        with np.load(path) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except Exception as err:
        raise DataError(f"Cannot read MedMNIST file '{path}' ({type(err).__name__}: {err}); "
                        "re-download it from the MedMNIST site.") from err
    needed = [f"{split}_{what}" for split in SPLITS for what in ("images", "labels")]
    missing = [key for key in needed if key not in arrays]
    if missing:
        raise DataError(f"MedMNIST file '{path}' lacks key(s) {', '.join(missing)}; expected {', '.join(needed)}.")
    labels, images = {}, {}
    multi_label = arrays["train_labels"].ndim == 2 and arrays["train_labels"].shape[1] > 1
    for split in SPLITS:
        raw = arrays[f"{split}_labels"]
        if multi_label != (raw.ndim == 2 and raw.shape[1] > 1):
            raise DataError(f"MedMNIST file '{path}': {split}_labels has shape {raw.shape} but train_labels "
                            f"{arrays['train_labels'].shape}; every split must be single- or multi-label alike.")
        flat = raw if multi_label else raw.reshape(-1)
        fractional = np.argwhere(flat % 1 != 0) if flat.dtype.kind == "f" else []
        if len(fractional):  # astype(int64) would truncate 0.7 to class 0 without a word
            at = tuple(int(i) for i in fractional[0])
            raise DataError(f"MedMNIST file '{path}': {split}_labels[{', '.join(map(str, at))}] is "
                            f"{float(flat[at]):g}, not a class id; labels must be whole numbers.")
        labels[split] = flat.astype(np.int64)
        pixels = arrays[f"{split}_images"]
        images[split] = pixels[..., None] if pixels.ndim == 3 else pixels
        if images[split].ndim != 4 or images[split].shape[-1] not in (1, 3) or images[split].dtype != np.uint8:
            raise DataError(f"MedMNIST file '{path}': {split}_images is {pixels.dtype} {pixels.shape}; "
                            "expected uint8 (N, H, W) or (N, H, W, 3).")
    where = lambda split, row: f"'{path}' {split}_labels[{row}]"  # noqa: E731
    check = _check_multi_hot if multi_label else _check_labels
    num_found = check(labels, num_classes, where)
    attributes = {split: _npz_attributes(arrays, split, len(labels[split]), path) for split in SPLITS}
    sets = {split: ImageSet(labels=labels[split], num_classes=num_found, channels=images[split].shape[-1],
                            images=images[split], attributes=attributes[split], name=f"medmnist:{path}[{split}]")
            for split in SPLITS}
    return DataSplits(**sets, info={"class_names": [f"class_{k}" for k in range(num_found)]})


def _npz_attributes(arrays: dict[str, np.ndarray], split: str, count: int, path: str) -> np.ndarray | None:
    """Optional ``<split>_attributes`` (one int per image, e.g. 0 light / 1 dark) in a MedMNIST-layout file."""
    raw = arrays.get(f"{split}_attributes")
    if raw is None:
        return None
    values = np.asarray(raw).reshape(-1)
    if values.shape[0] != count or values.dtype.kind not in "iub":
        raise DataError(f"'{path}': {split}_attributes must hold one integer per image ({count}), got "
                        f"{values.dtype} {np.asarray(raw).shape}.")
    return values.astype(np.int64)


def _load_folder(root: str, seed: int, num_classes: int | None, left_out: tuple[str, ...] = ()) -> DataSplits:
    _require_path(root, "Image folder", "dir")
    present = [split for split in SPLITS if os.path.isdir(os.path.join(root, split))]
    if present and len(present) < len(SPLITS):
        absent = [split for split in SPLITS if split not in present]
        raise DataError(
            f"Image folder '{root}' has split folder(s) {', '.join(present)} but not {', '.join(absent)}; add "
            "the missing split folder(s), or use class folders only to get a seeded stratified 70/15/15 split."
        )
    split_roots = {split: os.path.join(root, split) for split in present} or {"all": root}
    class_names = sorted({name for folder in split_roots.values() for name in _subfolders(folder)})
    skipped = {name: sum(len(_list_class_files(folder, [name])[0]) for folder in split_roots.values())
               for name in class_names if same_form(name) in left_out}  # the class_map nulls: listed, never read
    class_names = [name for name in class_names if name not in skipped]
    if skipped and not class_names:
        raise DataError(f"Image folder '{root}': class_map leaves out every class ({', '.join(skipped)}); keep "
                        "at least one.")
    if not class_names:
        raise DataError(f"Image folder '{root}' has no class folders; expected {root}/<class_name>/<image files>.")
    if num_classes is not None and num_classes != len(class_names):
        raise DataError(
            f"Image folder '{root}' has {len(class_names)} class folders ({', '.join(class_names)}) but "
            f"num_classes={num_classes} is declared; add/remove class folders or fix num_classes."
        )
    files = {split: _list_class_files(folder, class_names) for split, folder in split_roots.items()}
    counts = np.bincount(np.concatenate([labels for _, labels in files.values()]), minlength=len(class_names))
    if (counts == 0).all():
        raise DataError(f"Image folder '{root}': its class folders ({', '.join(class_names)}) hold no images with "
                        f"suffixes {', '.join(IMAGE_SUFFIXES)}; add images.")
    if (counts == 0).any():  # an empty class folder is a class this site lacks (a job may name it: align_to_job)
        kept = np.flatnonzero(counts)
        renumber = np.cumsum(counts > 0) - 1  # old class id -> its id among the kept classes
        class_names = [class_names[k] for k in kept]
        files = {split: (paths, renumber[labels]) for split, (paths, labels) in files.items()}
    patients, key = _folder_patients(files, split_roots)
    note = ""
    if "all" in files:
        (paths, labels), every = files["all"], patients["all"]
        parts, note = grouped_split(labels, every, seed)
        files = {split: ([paths[i] for i in part], labels[part]) for split, part in zip(SPLITS, parts)}
        patients = {split: None if every is None else every[part] for split, part in zip(SPLITS, parts)}
    splits = _with_patients(_file_splits(files, len(class_names), f"folder:{root}", class_names), patients, key, note)
    splits.info |= {"named_classes": True, "left_out": skipped}
    return splits


def manifest_rows(manifest: str | os.PathLike) -> csv.DictReader:
    """A CSV manifest's rows, in the encoding and separator spreadsheet programs write: UTF-8 with or without a byte
    order mark, UTF-16 with one ("Unicode text", tab-separated), else Windows-1252 ("CSV" on Windows; Latin-1 for
    its five undefined bytes). A UTF-16 or Latin-1 manifest used to end in a traceback."""
    try:
        raw = Path(manifest).read_bytes()
    except OSError as exc:
        raise DataError(f"CSV manifest '{manifest}' cannot be read ({exc.strerror or exc}).") from exc
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        text = raw.decode("utf-16")
    else:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            try:
                text = raw.decode("cp1252")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
    first = text.split("\n", 1)[0]
    return csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if "\t" in first and "," not in first else ",")


def _read_manifest(manifest: str) -> tuple[list[str], list[tuple[dict[str, str], int]]]:
    """Header and (row dict, line number) pairs of a CSV manifest, with the required columns checked."""
    _require_path(manifest, "CSV manifest", "file")
    reader = manifest_rows(manifest)
    header = [name.strip() for name in reader.fieldnames or []]
    missing = [name for name in CSV_REQUIRED if name not in header]
    if "label" in missing and len(class_columns(header)) > 1:
        missing.remove("label")  # a multi-label manifest
    if missing:
        raise DataError(f"CSV manifest '{manifest}' lacks column(s) {', '.join(missing)}; the header must be "
                        f"path,label (or path,{CSV_CLASS_PREFIX}<class>,... for multi-label) with optional "
                        f"{','.join(CSV_OPTIONAL)} (found: {','.join(header)}).")
    rows = [({key.strip(): (value or "").strip() for key, value in row.items() if key}, line)
            for line, row in enumerate(reader, start=2)]
    if not rows:
        raise DataError(f"CSV manifest '{manifest}' has no data rows.")
    return header, rows


def _load_csv(manifest: str, seed: int, num_classes: int | None, left_out: tuple[str, ...] = (),
              patient_column: str = PATIENT_COLUMN) -> DataSplits:
    header, rows = _read_manifest(manifest)
    if patient_column != PATIENT_COLUMN and patient_column not in header:
        raise DataError(f"CSV manifest '{manifest}' has no column '{patient_column}' (data.patient_column); name one "
                        f"of its columns: {','.join(header)}.")
    skipped: dict[str, int] = {}  # the class_map nulls by class_name: their rows are dropped, their files never read
    if left_out and "class_name" in header:
        skipped = dict(collections.Counter(row["class_name"] for row, _ in rows
                                           if same_form(row["class_name"]) in left_out))
        rows = [(row, line) for row, line in rows if row["class_name"] not in skipped]
        if not rows:
            raise DataError(f"CSV manifest '{manifest}': class_map leaves out every class ({', '.join(skipped)}); "
                            "keep at least one.")
    base = os.path.dirname(os.path.abspath(manifest))

    def at(line: int) -> str:
        return f"'{manifest}' line {line}"

    def integer(row: dict, column: str, line: int) -> int:
        try:
            return int(row[column])
        except ValueError as err:
            raise DataError(f"{at(line)}: {column} '{row[column]}' is not an integer.") from err

    paths = []
    for row, line in rows:
        path = row["path"] if os.path.isabs(row["path"]) else os.path.join(base, row["path"])
        if not row["path"] or not os.path.isfile(path):
            raise DataError(f"{at(line)}: image file '{path}' does not exist; fix the path (relative to the CSV's "
                            "folder) or remove the row.")
        if not is_image_file(path):
            raise DataError(f"{at(line)}: '{path}' is not a supported image ({', '.join(IMAGE_SUFFIXES)}).")
        paths.append(path)
    lines = [line for _, line in rows]
    where = lambda _, row: at(lines[row])  # noqa: E731
    columns_of_classes = class_columns(header)
    if "label" in header:
        labels = np.array([integer(row, "label", line) for row, line in rows], dtype=np.int64)
        num_found = _check_labels({"all": labels}, num_classes, where=where)
        class_names = [f"class_{k}" for k in range(num_found)]
    else:
        labels = np.array([[_multi_hot_entry(row[c], at(line), c) for c in columns_of_classes] for row, line in rows],
                          dtype=np.int64)
        num_found = _check_multi_hot({"all": labels}, num_classes, where)
        class_names = [column[len(CSV_CLASS_PREFIX):] for column in columns_of_classes]
    columns: dict[str, np.ndarray] = {}
    if patient_column in header:  # an empty cell: the row is a patient of its own
        patients = np.array([row[patient_column] or f"row {line}" for row, line in rows], dtype=object)
        patient_key: str | None = f"{patient_column} column"
    else:  # a manifest of DICOM files: their headers name the patients, as in a folder source
        patients, patient_key = _dicom_patients(paths)
    if patients is not None:
        columns["patients"] = patients
    if "attribute" in header:
        columns["attributes"] = np.array([integer(row, "attribute", line) for row, line in rows], dtype=np.int64)
    if "site" in header:
        columns["groups"] = np.array([row["site"] for row, _ in rows], dtype=object)
    if "split" in header:
        names = [row["split"].lower() for row, _ in rows]
        bad = next((i for i, name in enumerate(names) if name not in SPLITS), None)
        if bad is not None:
            raise DataError(f"{at(lines[bad])}: split '{rows[bad][0]['split']}' is not one of {', '.join(SPLITS)}.")
        parts, note = [np.flatnonzero(np.array(names) == split) for split in SPLITS], ""
    else:
        parts, note = grouped_split(multi_label_strata(labels) if labels.ndim == 2 else labels, patients, seed)
    channels, image_size = _probe_first_image(paths)
    shapes = probe_shapes(paths)
    sets = {split: ImageSet(labels=labels[part], num_classes=num_found, channels=channels,
                            paths=[paths[i] for i in part], name=f"csv:{manifest}[{split}]",
                            **{key: value[part] for key, value in columns.items()})
            for split, part in zip(SPLITS, parts)}
    info = {"class_names": class_names, "image_size": image_size, "image_shapes": shapes,
            "grouping": _grouping(sets, patient_key, note)}
    if columns_of_classes and "label" not in header:
        info["named_classes"] = True  # the label_<name> columns name the classes
    if "class_name" in header and "label" in header:
        info |= {"class_names": _csv_class_names(rows, labels, num_found, at), "named_classes": True,
                 "left_out": skipped}
    return DataSplits(**sets, info=info)


def class_columns(header: list[str]) -> list[str]:
    """The `label_<class>` columns of a multi-label manifest header, in header order."""
    return [name for name in header if name.startswith(CSV_CLASS_PREFIX) and len(name) > len(CSV_CLASS_PREFIX)]


def _multi_hot_entry(text: str, where: str, column: str) -> int:
    """One multi-label CSV cell: 1 positive, 0 negative, -1 or empty = not annotated."""
    if text in ("", "-1"):
        return UNLABELED
    if text in ("0", "1"):
        return int(text)
    raise DataError(f"{where}: {column} '{text}' must be 1, 0, or -1 / empty for not annotated.")


def _check_multi_hot(labels: dict[str, np.ndarray], num_classes: int | None,
                     where: Callable[[str, int], str]) -> int:
    """Checks multi-hot label rows (entries 1, 0 or -1) against the declared K and returns K."""
    found = next(iter(labels.values())).shape[1]
    if num_classes is not None and num_classes != found:
        raise DataError(f"{where(next(iter(labels)), 0)}: the data has {found} label columns but num_classes="
                        f"{num_classes} is declared; fix num_classes.")
    for split, values in labels.items():
        bad = np.argwhere(~np.isin(values, (UNLABELED, 0, 1)))
        if len(bad):
            row, column = (int(i) for i in bad[0])
            raise DataError(f"{where(split, row)}: entry {int(values[row, column])} of class {column} must be 1, 0 "
                            "or -1 (not annotated).")
    return found


def _csv_class_names(rows: list[tuple[dict[str, str], int]], labels: np.ndarray, num_classes: int,
                     at: Callable[[int], str]) -> list[str]:
    """One name per label id from the `class_name` column; a label with two names, or a name on two labels, fails."""
    names: dict[int, str] = {}
    for (row, line), label in zip(rows, labels):
        name = row["class_name"]
        if not name:
            raise DataError(f"{at(line)}: class_name is empty; give every row its class's name.")
        if names.setdefault(int(label), name) != name:
            raise DataError(f"{at(line)}: label {label} is named '{name}' here but '{names[int(label)]}' earlier; "
                            "each label needs one class_name.")
    owners = {}
    for label, name in sorted(names.items()):
        if owners.setdefault(name, label) != label:
            raise DataError(f"'{name}' names both label {owners[name]} and label {label} in the class_name column; "
                            "each class needs its own name.")
    return [names.get(k, f"class_{k}") for k in range(num_classes)]


def stratified_split(labels: np.ndarray, fractions: tuple[float, ...], seed: int) -> list[np.ndarray]:
    """Seeded stratified split of sample indices into len(fractions) sorted parts: per class, shuffled and cut at
    the rounded cumulative fractions (a class with a single sample goes to the first part)."""
    rng = np.random.default_rng([seed, 7])
    edges = np.cumsum(fractions)[:-1] / np.sum(fractions)
    parts: list[list[np.ndarray]] = [[] for _ in fractions]
    for k in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == k))
        cuts = np.rint(edges * len(members)).astype(int)
        cuts[0] = max(cuts[0], 1)  # the first (training) part never loses a class entirely
        for part, chunk in zip(parts, np.split(members, np.maximum.accumulate(cuts))):
            part.append(chunk)
    return [np.sort(np.concatenate(part)) if part else np.empty(0, dtype=np.int64) for part in parts]


def grouped_split(strata: np.ndarray, patients: np.ndarray | None, seed: int) -> tuple[list[np.ndarray], str]:
    """Seeded, stratified train/val/test index parts (sorted) near 70/15/15 that keep each patient's images in one
    part, and a note ("" when none): sklearn's StratifiedGroupKFold deals whole patients into 20 folds (fewer with
    fewer patients), 3 of 20 become val, 3 test, the rest train; a class with no patient in train gets one moved
    there, as `stratified_split` keeps every class in train. Without patients (None) the images are split one by
    one; with fewer than `MIN_GROUPS` too, and the note (also logged) says that patients may then share splits."""
    from sklearn.model_selection import StratifiedGroupKFold

    if patients is None:
        return stratified_split(strata, SPLIT_FRACTIONS, seed), ""
    _, group_of = np.unique(np.asarray(patients).astype(str), return_inverse=True)
    num_groups = int(group_of.max()) + 1 if len(group_of) else 0
    if num_groups < MIN_GROUPS:
        note = (f"only {num_groups} patient(s), too few to keep each in one of 3 splits: the images are split one by "
                f"one, so a patient's images may be in train and test; add patients (at least {MIN_GROUPS})")
        _LOG.warning("medflare: %s", note)
        return stratified_split(strata, SPLIT_FRACTIONS, seed), note
    folds = min(GROUP_FOLDS, num_groups)
    held = [max(1, round(folds * fraction)) for fraction in SPLIT_FRACTIONS[1:]]  # val and test folds
    splitter = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
    part_of = np.zeros(len(strata), dtype=np.int64)  # 0 train, 1 val, 2 test
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "least populated class has fewer members than n_splits"
        for fold, (_, members) in enumerate(splitter.split(np.zeros(len(strata)), strata, group_of)):
            part_of[members] = 1 if fold < held[0] else 2 if fold < sum(held) else 0
    for k in np.unique(strata):
        members = np.flatnonzero(strata == k)
        if not (part_of[members] == 0).any():
            part_of[group_of == group_of[members[0]]] = 0
    return [np.flatnonzero(part_of == part) for part in range(len(SPLITS))], ""


def _check_labels(labels: dict[str, np.ndarray], num_classes: int | None,
                  where: Callable[[str, int], str]) -> int:
    """Checks labels against [0, C) and returns C (the declared count, or max label + 1)."""
    everything = np.concatenate(list(labels.values()))
    if len(everything) == 0:
        raise DataError(f"{where(next(iter(labels)), 0)}: the source has no labelled samples.")
    limit = num_classes if num_classes is not None else max(int(everything.max()) + 1, 1)
    for split, values in labels.items():
        bad = np.flatnonzero((values < 0) | (values >= limit))
        if len(bad) == 0:
            continue
        row, value = int(bad[0]), int(values[bad[0]])
        if value < 0:
            raise DataError(f"{where(split, row)}: label {value} is negative; labels must be class ids in "
                            f"[0, {limit}). Correct the label.")
        raise DataError(f"{where(split, row)}: label {value} is outside [0, {limit}): the data needs "
                        f"num_classes >= {int(everything.max()) + 1} but {num_classes} is declared; fix "
                        "num_classes or the label.")
    return limit


def _file_splits(files: dict[str, tuple[list[str], np.ndarray]], num_classes: int, name: str,
                 class_names: list[str]) -> DataSplits:
    every_path = [path for paths, _ in files.values() for path in paths]
    channels, image_size = _probe_first_image(every_path)
    sets = {split: ImageSet(labels=labels, num_classes=num_classes, channels=channels, paths=list(paths),
                            name=f"{name}[{split}]") for split, (paths, labels) in files.items()}
    info = {"class_names": class_names, "image_size": image_size, "image_shapes": probe_shapes(every_path)}
    return DataSplits(**sets, info=info)


def _folder_patients(files: dict[str, tuple[list[str], np.ndarray]],
                     split_roots: dict[str, str]) -> tuple[dict[str, np.ndarray | None], str | None]:
    """Per split, the patient of each image file, and the key that names them (None, and no arrays, when no file
    names one): a DICOM's PatientID or StudyInstanceUID (`dicom_patient`, the header only), else the folder below
    its class folder (<class>/<patient>/...). A file naming none is a patient of its own."""
    found = [_file_patient(path, split_roots[split]) for split, (paths, _) in files.items() for path in paths]
    every, key = _named_patients(found, [path for paths, _ in files.values() for path in paths])
    if every is None:
        return dict.fromkeys(files), None
    ends = np.cumsum([len(paths) for paths, _ in files.values()])[:-1]
    return dict(zip(files, np.split(every, ends))), key


def _named_patients(found: list[tuple[str, str] | None], paths: list[str]) -> tuple[np.ndarray | None, str | None]:
    """The patient of each file from its (key, patient) or None (then the file is a patient of its own), and the
    key(s) that named them; (None, None) when no file names one."""
    keys = sorted({patient[0] for patient in found if patient is not None})
    if not keys:
        return None, None
    patients = np.array([path if patient is None else patient[1] for path, patient in zip(paths, found)], dtype=object)
    return patients, " or ".join(keys)


def _dicom_patients(paths: list[str]) -> tuple[np.ndarray | None, str | None]:
    """`_named_patients` of files whose DICOM headers name their patient (other formats name none)."""
    return _named_patients([dicom_patient(path) if path.lower().endswith(DICOM_SUFFIXES) else None for path in paths],
                           paths)


def _file_patient(path: str, folder: str) -> tuple[str, str] | None:
    """(key, patient) of one image file under a split's ``folder``, or None (see `_folder_patients`). A DICOM's own
    header comes first: exports often hold one folder per series (<class>/<series>/*.dcm), and two series of one
    patient named by their folders would be two patients, free to land in train and test."""
    header = dicom_patient(path) if path.lower().endswith(DICOM_SUFFIXES) else None
    parts = Path(os.path.relpath(path, folder)).parts  # <class>/[<patient>/...]<file>
    return header or ((PATIENT_FOLDER, parts[1]) if len(parts) > 2 else None)


def _with_patients(splits: DataSplits, patients: dict[str, np.ndarray | None], key: str | None,
                   note: str) -> DataSplits:
    """``splits`` with each set's patients and `info["grouping"]`."""
    sets = {split: dataclasses.replace(getattr(splits, split), patients=patients[split]) for split in SPLITS}
    return DataSplits(**sets, info=splits.info | {"grouping": _grouping(sets, key, note)})


def _grouping(sets: dict[str, ImageSet], key: str | None, note: str) -> dict:
    """`info["grouping"]`: the patient key (None: not known, each image is split alone), the patients per split,
    how many patients have images in more than one split (explicit splits can do that), and the split's note."""
    if key is None:
        return {"key": None, "groups": None, "shared": None, "note": note}
    return {"key": key, "groups": {split: len(set(image_set.patients)) for split, image_set in sets.items()},
            "shared": len(shared_patients(sets)), "note": note}


def shared_patients(sets: dict[str, ImageSet]) -> list[str]:
    """The patients (sorted) with images in more than one of ``sets``, whose patients are known."""
    splits_of = collections.Counter(patient for image_set in sets.values() for patient in set(image_set.patients))
    return sorted(str(patient) for patient, count in splits_of.items() if count > 1)


def _probe_first_image(paths: list[str]) -> tuple[int, int]:
    """Channels (1 or 3) and height of the first image, the source's native format (others are converted and
    resized on access)."""
    pixels = read_image(paths[0])
    return (1 if pixels.shape[-1] == 1 else 3), int(pixels.shape[0])


def probe_shapes(paths: list[str], most: int = SHAPE_PROBES) -> list[tuple[int, int]]:
    """The distinct (height, width) of up to ``most`` of ``paths``, spread evenly over them (sorted): read from
    PNG/JPEG/TIFF headers only (a DICOM or NIfTI counts by its first image's size), to tell a source whose images
    are not all one square size."""
    from PIL import Image

    step = max(1, len(paths) // most)
    shapes = set()
    for path in paths[::step][:most]:
        if path.lower().endswith(PIL_SUFFIXES):
            try:
                with Image.open(path) as image:  # the header: no pixel is decoded
                    shapes.add((int(image.height), int(image.width)))
            except Exception:  # noqa: BLE001 - a broken file is named when it is read (read_image's DataError)
                continue
    return sorted(shapes)


def _describe(splits: DataSplits, spec: str, kind: str) -> dict:
    train = splits.train
    image_size = splits.info["image_size"] if "image_size" in splits.info else int(train.images.shape[1])
    return {
        "source": spec,
        "kind": kind,
        "num_classes": train.num_classes,
        "channels": train.channels,
        "image_size": image_size,
        "counts": {split: labelled_counts(getattr(splits, split).labels, train.num_classes).tolist()
                   for split in SPLITS},
        "multi_label": train.multi_label,
    }


def _freeze(image_set: ImageSet) -> None:
    """Marks cached arrays read-only, so no caller can silently change what other sites load."""
    for array in (image_set.labels, image_set.images, image_set.attributes, image_set.groups, image_set.patients):
        if array is not None:
            array.setflags(write=False)


def _require_path(path: str, what: str, kind: str) -> None:
    exists = os.path.isdir(path) if kind == "dir" else os.path.isfile(path)
    if not exists:
        raise DataError(f"{what} '{path}' does not exist (or is not a {'folder' if kind == 'dir' else 'file'}); "
                        "fix the path in the data source spec.")


def _subfolders(folder: str) -> list[str]:
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith("."))


def _list_class_files(folder: str, class_names: list[str]) -> tuple[list[str], np.ndarray]:
    """Image files under `folder/<class>/`, also in its subfolders (`<class>/<patient>/*.dcm`; hidden ones skipped),
    in sorted order (so labels come in a deterministic order)."""
    paths, labels = [], []
    for label, name in enumerate(class_names):
        for current, subfolders, file_names in os.walk(os.path.join(folder, name)):
            subfolders[:] = sorted(sub for sub in subfolders if not sub.startswith("."))
            for file_name in sorted(file_names):
                path = os.path.join(current, file_name)
                if is_image_file(file_name) and os.path.isfile(path):
                    paths.append(path)
                    labels.append(label)
    return paths, np.array(labels, dtype=np.int64)
