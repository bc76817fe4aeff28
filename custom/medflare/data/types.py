"""Containers for image data: one split (`ImageSet`) and a train/val/test triple (`DataSplits`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from medflare.data.readers import WindowSpec, read_image
from medflare.errors import DataError

#: Label value of a sample whose class this site does not annotate (label-set mismatch, FedLSM); in multi-label
#: sets, the value of one unknown (not annotated) entry.
UNLABELED = -1


@dataclass
class ImageSet:
    """One split of a classification data set: exactly one of uint8 `[N, H, W, C]` `images` in memory or N
    `paths` decoded on access (with the DICOM/NIfTI intensity `window`; None = min-max).

    Labels are int64 `[N]` class ids or `[N, K]` multi-hot rows (1, 0); unknown is `UNLABELED` (-1) in both, for
    a whole sample or one entry, so masks are `labels >= 0` either way and no NaN handling is needed anywhere.
    `num_classes` is the task's; `attributes` an optional int64 `[N]` binary attribute (0 light / 1 dark skin);
    `groups` a CSV manifest's site column; `patients` the patient (or study) each image comes from, whose images
    all share one split (None: not known); `name` where the set comes from, for messages.
    """

    labels: np.ndarray
    num_classes: int
    channels: int
    images: np.ndarray | None = None
    paths: list[str] | None = None
    attributes: np.ndarray | None = None
    groups: np.ndarray | None = None
    patients: np.ndarray | None = None
    name: str = ""
    window: WindowSpec = None

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels, dtype=np.int64)
        self.labels = labels if labels.ndim == 2 and labels.shape[1] > 1 else labels.reshape(-1)
        where = f"image set '{self.name}'"
        if (self.images is None) == (self.paths is None):
            raise DataError(f"{where}: give exactly one of `images` (in memory) or `paths` (files).")
        if self.channels not in (1, 3):
            raise DataError(f"{where}: channels must be 1 or 3, got {self.channels}.")
        if self.images is not None and (self.images.ndim != 4 or self.images.shape[-1] != self.channels):
            raise DataError(
                f"{where}: images must be uint8 [N, H, W, {self.channels}], got shape {self.images.shape}."
            )
        n = len(self.labels)
        stored = len(self.images) if self.images is not None else len(self.paths or [])
        if stored != n:
            raise DataError(f"{where}: {stored} images but {n} labels.")
        if self.attributes is not None:
            self.attributes = np.asarray(self.attributes, dtype=np.int64).reshape(-1)
        for column, values in (("attributes", self.attributes), ("groups", self.groups), ("patients", self.patients)):
            if values is not None and len(values) != n:
                raise DataError(f"{where}: {column} has {len(values)} entries but there are {n} labels.")
        if self.multi_label:
            _check_multi_hot(self.labels, self.num_classes, where)
            return
        bad = (self.labels < UNLABELED) | (self.labels >= self.num_classes)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{where}: label {int(self.labels[row])} at row {row} is outside [0, {self.num_classes}) "
                f"(or {UNLABELED} for unlabeled); fix the label or declare more classes."
            )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def multi_label(self) -> bool:
        """Whether the labels are multi-hot rows `[N, K]` (several findings per image) rather than class ids."""
        return self.labels.ndim == 2

    @property
    def in_memory(self) -> bool:
        """Whether the pixels are held in `images` (True) or decoded from `paths` on access (False)."""
        return self.images is not None

    def subset(self, indices: np.ndarray) -> ImageSet:
        """Returns the samples at `indices` (in that order) as a new set; arrays are copied, not shared."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        return ImageSet(
            labels=self.labels[indices],
            num_classes=self.num_classes,
            channels=self.channels,
            images=None if self.images is None else self.images[indices],
            paths=None if self.paths is None else [self.paths[i] for i in indices],
            attributes=None if self.attributes is None else self.attributes[indices],
            groups=None if self.groups is None else self.groups[indices],
            patients=None if self.patients is None else self.patients[indices],
            name=self.name,
            window=self.window,
        )

    def get_image(self, i: int) -> np.ndarray:
        """Returns sample `i` as a fresh `[H, W, channels]` array: uint8, or float32 in [0, 1] for a file deeper
        than 8 bits; DataError when its file is missing, corrupt or unsupported."""
        if self.images is not None:
            # A copy, so callers can never write into a cached source.
            return np.array(self.images[i])
        path = self.paths[i]
        try:
            return read_image(path, self.channels, self.window)
        except DataError as err:
            raise DataError(f"{err} (sample {i} of image set '{self.name}')") from err


def _check_multi_hot(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Multi-label rows must have K entries, each 1, 0 or `UNLABELED`."""
    if labels.shape[1] != num_classes:
        raise DataError(f"{where}: multi-label rows have {labels.shape[1]} entries but num_classes={num_classes}; "
                        "give one column per class.")
    bad = ~np.isin(labels, (UNLABELED, 0, 1))
    if bad.any():
        row, column = (int(i[0]) for i in np.nonzero(bad))
        raise DataError(f"{where}: multi-label entry {int(labels[row, column])} at row {row}, class {column} is not "
                        f"1, 0 or {UNLABELED} (unknown); fix the label.")


def labelled_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 `[K]` per class: labelled samples (single-label) or known positives (multi-label)."""
    labels = np.asarray(labels)
    if labels.ndim == 2:
        return (labels == 1).sum(axis=0).astype(np.int64)
    return np.bincount(labels[labels >= 0], minlength=num_classes).astype(np.int64)


def labelled_rows(labels: np.ndarray) -> np.ndarray:
    """bool `[N]`: samples with a label (single-label) or with at least one known entry (multi-label)."""
    labels = np.asarray(labels)
    return (labels >= 0).any(axis=1) if labels.ndim == 2 else labels >= 0


@dataclass
class DataSplits:
    """Train/val (model selection only)/test (reporting only) splits of one source, and its `info`: `source`,
    `kind`, `class_names`, `num_classes`, `channels`, `image_size`, per-split `counts` and source-specific keys."""

    train: ImageSet
    val: ImageSet
    test: ImageSet
    info: dict = field(default_factory=dict)
