"""Data sources from outside medflare: ``--data KIND:ARGUMENT`` for a kind that a plugin or a package adds.

A plugin is a function ``(argument, seed) -> DataSplits`` registered under a kind (``lesions:/data/lesions``
calls ``lesions`` with ``/data/lesions``): ``@register_source`` in a job's plugin file, or an entry point in the
``medflare.data_sources`` group of an installed package, imported when the kind is first used.
:func:`splits_from_datasets` turns your own datasets (e.g. MONAI's, with their deterministic transforms) into
in-memory uint8 splits, read once; medflare's augmentation comes after. See ``docs/own-model-and-data.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from medflare.data.types import DataSplits, ImageSet
from medflare.errors import ConfigError, DataError
from medflare.installed import installed_entry_points, load_entry_point

__all__ = [
    "ENTRY_POINT_GROUP", "SourcePlugin", "find_source", "image_set_from_dataset", "plugin_loader", "register_source",
    "source_kinds", "splits_from_datasets",
]

#: The entry-point group an installed package declares its data sources in.
ENTRY_POINT_GROUP = "medflare.data_sources"
# Kinds medflare itself gives a meaning: a plugin cannot take them over ("site" is the job's "each site's own
# data", "images" the public-set form of data.public_source).
RESERVED_KINDS = frozenset({"synthetic", "medmnist", "folder", "csv", "site", "images"})
# Float images may overshoot [0, 1] by rounding (an interpolating resize after scaling); clipped, not refused.
FLOAT_SLACK = 1e-3


class SourcePlugin(Protocol):
    """Loads one data source: the spec's argument (after ``KIND:``, may be "") and the job's seed -> splits."""

    def __call__(self, argument: str, seed: int) -> DataSplits: ...


class MapDataset(Protocol):
    """What :func:`splits_from_datasets` reads: any map-style dataset (``torch.utils.data.Dataset``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


_SOURCES: dict[str, SourcePlugin] = {}


def register_source(kind: str) -> Callable[[SourcePlugin], SourcePlugin]:
    """Decorator that registers a data-source plugin for specs ``KIND:ARGUMENT``; ConfigError when ``kind`` is
    not a plain name, is one of medflare's own, or is registered twice."""

    def decorate(plugin: SourcePlugin) -> SourcePlugin:
        if not kind.isidentifier() or kind in RESERVED_KINDS:
            raise ConfigError(f"data source kind '{kind}' must be a plain name (letters, digits, '_') other than "
                              f"medflare's own: {', '.join(sorted(RESERVED_KINDS))}")
        if kind in _SOURCES:
            raise ConfigError(f"data source '{kind}' is registered twice (by {_SOURCES[kind].__module__} and "
                              f"{plugin.__module__})")
        _SOURCES[kind] = plugin
        return plugin

    return decorate


def source_kinds() -> list[str]:
    """The kinds plugins registered in this process and installed packages declare, sorted."""
    return sorted(set(_SOURCES) | set(installed_entry_points(ENTRY_POINT_GROUP)))


def find_source(kind: str) -> SourcePlugin | None:
    """The plugin for ``kind`` (an installed one is imported here, ConfigError when it cannot be), or None."""
    if kind in _SOURCES or kind in RESERVED_KINDS:
        return _SOURCES.get(kind)
    entry = installed_entry_points(ENTRY_POINT_GROUP).get(kind)
    if entry is None:
        return None
    plugin = load_entry_point(entry, f"data source '{kind}'", "(argument, seed) -> DataSplits")
    return _SOURCES.setdefault(kind, plugin)  # importing the module may have registered it with @register_source


def plugin_loader(kind: str) -> Callable[[str, int, int | None], DataSplits] | None:
    """``load_source``'s loader for a plugin kind: the plugin, its result checked; None for an unknown kind."""
    plugin = find_source(kind)
    if plugin is None:
        return None

    def load(argument: str, seed: int, num_classes: int | None) -> DataSplits:
        splits = plugin(argument, seed)
        where = f"data source '{kind}:{argument}' ({plugin.__module__})"
        if not isinstance(splits, DataSplits):
            raise DataError(f"{where} returned a {type(splits).__name__}, not DataSplits; build it with "
                            "medflare.data.plugins.splits_from_datasets")
        found = splits.train.num_classes
        if num_classes is not None and num_classes != found:
            raise DataError(f"{where} has {found} classes but num_classes={num_classes} is declared; fix the "
                            "declared task.num_classes or the source's class list")
        return splits

    return load


def splits_from_datasets(
    train: MapDataset, val: MapDataset, test: MapDataset, *, class_names: Sequence[str]
) -> DataSplits:
    """Three map-style datasets as medflare's in-memory splits. Items are ``(image, label)`` or MONAI's
    ``{"image": ..., "label": ...}``; images ``[C, H, W]`` (C 1 or 3) or ``[H, W]``, uint8 or floats in [0, 1],
    one size for all; labels class ids in label order of ``class_names``, or K-long 0/1/-1 vectors.

    Raises:
        DataError: an empty split, an item that is not an image and a label, an image of another shape or
            channel count, a float image outside [0, 1], or a label outside the classes.
    """
    names = [str(name) for name in class_names]
    if len(names) < 2 or len(set(names)) != len(names):
        raise DataError(f"class_names must list at least 2 distinct names, got {names}")
    sets = {split: image_set_from_dataset(dataset, num_classes=len(names), name=split)
            for split, dataset in (("train", train), ("val", val), ("test", test))}
    shapes = {split: image_set.images.shape[1:] for split, image_set in sets.items()}
    if len(set(shapes.values())) > 1:
        raise DataError(f"the splits' images differ in shape (H, W, C): {shapes}; resize every split to one size "
                        "(e.g. monai.transforms.Resize)")
    return DataSplits(**sets, info={"class_names": names, "named_classes": True})


def image_set_from_dataset(dataset: MapDataset, *, num_classes: int, name: str = "") -> ImageSet:
    """Read every item of ``dataset`` once into an in-memory :class:`ImageSet` (uint8 ``[N, H, W, C]``)."""
    if len(dataset) == 0:
        raise DataError(f"dataset '{name}' is empty; every split needs at least one image")
    images, labels = [], []
    for index in range(len(dataset)):
        image, label = _image_and_label(dataset[index], f"dataset '{name}' item {index}")
        images.append(_uint8_hwc(image, f"dataset '{name}' item {index}"))
        labels.append(np.asarray(_numpy(label)))
    shapes = sorted({image.shape for image in images})
    if len(shapes) > 1:
        raise DataError(f"dataset '{name}': images come in {len(shapes)} shapes (H, W, C), e.g. {shapes[:3]}; "
                        "resize them to one size in the dataset's transform (e.g. monai.transforms.Resize)")
    return ImageSet(labels=_integer_labels(labels, name), num_classes=num_classes, channels=shapes[0][-1],
                    images=np.stack(images), name=name)


def _image_and_label(item: Any, where: str) -> tuple[Any, Any]:
    """An item's image and label: ``(image, label, ...)`` or MONAI's ``{"image": ..., "label": ...}``."""
    if isinstance(item, Mapping) and "image" in item and "label" in item:
        return item["image"], item["label"]
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        return item[0], item[1]
    raise DataError(f"{where} is a {type(item).__name__}; return (image, label) or {{'image': ..., 'label': ...}}")


def _uint8_hwc(image: Any, where: str) -> np.ndarray:
    """A channel-first (or 2-D) uint8 / [0, 1] float image as uint8 ``[H, W, C]``."""
    pixels = np.asarray(_numpy(image))
    if pixels.ndim == 2:
        pixels = pixels[None]
    if pixels.ndim != 3 or pixels.shape[0] not in (1, 3):
        raise DataError(f"{where}: image shape {pixels.shape} is not [C, H, W] with C 1 or 3, nor [H, W]; "
                        "e.g. add monai.transforms.EnsureChannelFirst (a 3-D volume: take a 2-D slice)")
    if pixels.dtype == np.uint8:
        return np.ascontiguousarray(pixels.transpose(1, 2, 0))
    low, high = (float(pixels.min()), float(pixels.max())) if pixels.size else (0.0, 0.0)
    if pixels.dtype.kind != "f" or not np.isfinite([low, high]).all() or low < -FLOAT_SLACK or high > 1 + FLOAT_SLACK:
        raise DataError(f"{where}: a {pixels.dtype} image with values in [{low:g}, {high:g}]; give uint8 pixels or "
                        "floats in [0, 1] (e.g. monai.transforms.ScaleIntensity)")
    scaled = np.round(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8)
    return np.ascontiguousarray(scaled.transpose(1, 2, 0))


def _integer_labels(labels: list[np.ndarray], name: str) -> np.ndarray:
    """int64 ``[N]`` class ids or ``[N, K]`` multi-hot rows; a fractional label is an error, not a truncation."""
    shapes = {label.shape for label in labels}
    if len(shapes) > 1:
        raise DataError(f"dataset '{name}': labels come in shapes {sorted(shapes)}; give every item a class id, or "
                        "every item a K-long 0/1 vector (multi-label)")
    stacked = np.stack(labels)
    if stacked.dtype.kind not in "iub" and (stacked.dtype.kind != "f" or (stacked % 1 != 0).any()):
        raise DataError(f"dataset '{name}': labels must be whole numbers (class ids or 0/1/-1 entries), "
                        f"got {stacked.dtype}")
    return stacked.astype(np.int64)


def _numpy(value: Any) -> Any:
    """A torch tensor (MONAI's MetaTensor too) as numpy; anything else unchanged."""
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value
