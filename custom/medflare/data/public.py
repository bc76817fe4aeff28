"""The unlabelled public image set of public-set distillation methods (MDH-FL, FedMD).

Every site reads the same public images in the same order, never their labels (`UNLABELED` from the start):
in simulation a seeded share of the training split held out before partitioning (`public_fraction`), or a set
every site holds a copy of (`public_source`: ``images:DIR``, sorted, or a `load_source` spec's train, val and test
images). `public_digest` fingerprints a copy, so sites can prove they read the same set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np

from medflare.data.readers import is_image_file, read_image
from medflare.data.sources import absolute_path, absolute_source, load_source
from medflare.data.types import UNLABELED, ImageSet
from medflare.errors import DataError

IMAGES_PREFIX = "images:"
_PUBLIC_STREAM = 11  # keeps the public draw independent of the partition's and the noise's random streams


def hold_out_public(train: ImageSet, fraction: float, seed: int) -> tuple[ImageSet | None, ImageSet]:
    """Splits a training split into (public set without labels, private pool) at a seeded random share (0: no
    public set); DataError when the share leaves either side empty."""
    if fraction <= 0:
        return None, train
    count = int(round(fraction * len(train)))
    if not 0 < count < len(train):
        raise DataError(
            f"data.public_fraction={fraction} of {len(train)} training images leaves {count} public and "
            f"{len(train) - count} private images; choose a fraction that leaves both sides non-empty."
        )
    chosen = np.random.default_rng([seed, _PUBLIC_STREAM]).permutation(len(train))[:count]
    public = np.zeros(len(train), dtype=bool)
    public[chosen] = True
    return unlabelled(train.subset(np.flatnonzero(public))), train.subset(np.flatnonzero(~public))


def load_public_source(spec: str, num_classes: int, channels: int, seed: int) -> ImageSet:
    """The public set a site holds a copy of (``images:DIR``, converted to the task's `channels`, or a
    `load_source` spec, which must match them), without labels, in a fixed order.

    Raises:
        DataError: The folder holds no image, or the source's channels differ from the task's.
    """
    if spec.startswith(IMAGES_PREFIX):
        return _image_folder(spec[len(IMAGES_PREFIX):], num_classes, channels)
    splits = load_source(spec, seed=seed)
    parts = (splits.train, splits.val, splits.test)
    if splits.train.channels != channels:
        raise DataError(
            f"public set '{spec}' has {splits.train.channels} channel(s) but the task has {channels}; "
            f"give a public set with {channels} channel(s) or use {IMAGES_PREFIX}DIR (converted on reading)"
        )
    if splits.train.in_memory:
        images = np.concatenate([part.images for part in parts])
        return ImageSet(labels=_no_labels(len(images)), num_classes=num_classes, channels=channels, images=images,
                        name=f"public:{spec}")
    paths = [path for part in parts for path in part.paths or []]
    return ImageSet(labels=_no_labels(len(paths)), num_classes=num_classes, channels=channels, paths=paths,
                    name=f"public:{spec}")


def absolute_public_source(spec: str, option: str = "data.public_source", check: bool = True) -> str:
    """``spec`` (``images:DIR`` or a `load_source` spec) with the path it names made absolute, as
    :func:`medflare.data.sources.absolute_source` does (DataError with ``check`` when it does not exist here)."""
    if spec.startswith(IMAGES_PREFIX) and spec[len(IMAGES_PREFIX):]:
        return IMAGES_PREFIX + absolute_path(spec[len(IMAGES_PREFIX):], "dir", option, check)
    return absolute_source(spec, option, check)


def unlabelled(image_set: ImageSet) -> ImageSet:
    """A copy of `image_set` whose labels are all `UNLABELED`, without attributes or groups."""
    return dataclasses.replace(image_set, labels=_no_labels(len(image_set)), attributes=None, groups=None,
                               name=f"public:{image_set.name}")


def public_digest(image_set: ImageSet) -> str:
    """SHA-256 hex digest of a set's images in order: the count, then per image its dtype, shape and exact bytes
    (never cast, so sets that differ beyond 8-bit precision differ), whatever the file names; labels do not enter."""
    digest = hashlib.sha256()
    digest.update(np.int64(len(image_set)).tobytes())
    for index in range(len(image_set)):
        image = np.asarray(image_set.get_image(index))
        # Little-endian bytes, so a copy read on any machine hashes the same; the header's length prefix keeps
        # "dtype and shape" from running into the pixel bytes.
        pixels = np.ascontiguousarray(image, dtype=image.dtype.newbyteorder("<"))
        header = f"{pixels.dtype.str}{pixels.shape}".encode()
        digest.update(np.int64(len(header)).tobytes() + header)
        digest.update(pixels.tobytes())
    return digest.hexdigest()


def check_public_options(fraction: float, source: str, local: bool) -> list[str]:
    """Problems of a data config's public-set options (empty when they are fine), for `DataConfig`."""
    problems = []
    if not 0.0 <= fraction < 1.0:
        problems.append(f"public_fraction={fraction} must be in [0, 1)")
    if fraction > 0 and source:
        problems.append("give either public_fraction (a held-out share, simulation) or public_source, not both")
    if fraction > 0 and local:
        problems.append("public_fraction holds out part of a simulated source; a real site reads its copy of the "
                        "public set from public_source in its local/medflare_site.json")
    return problems


def _image_folder(root: str, num_classes: int, channels: int) -> ImageSet:
    if not os.path.isdir(root):
        raise DataError(f"public image folder '{root}' does not exist; fix data.public_source")
    paths = sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        for name in names
        if is_image_file(name) and not name.startswith(".")
    )
    if not paths:
        raise DataError(f"public image folder '{root}' holds no image files; fix data.public_source")
    read_image(paths[0], channels)  # fail now, not in round 1, on an unreadable first file
    return ImageSet(labels=_no_labels(len(paths)), num_classes=num_classes, channels=channels, paths=paths,
                    name=f"public:{IMAGES_PREFIX}{root}")


def _no_labels(count: int) -> np.ndarray:
    return np.full(count, UNLABELED, dtype=np.int64)
