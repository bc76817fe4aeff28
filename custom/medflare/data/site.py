"""Per-site data: the torch `ImageDataset`, the `DataConfig` of a job, and `make_site_data` for one site.

Simulation: every site loads the same source with the same seed and keeps only its own slice, so no data ever
travels. Val/test are split IID (`eval_split="pooled"`) or with each site's training class mix ("like_train");
either way the slices tile the pooled splits, so summed per-site confusion counts give the pooled metric.
POC/production (`local=True`): the source is the site's own data, used whole.

Training labels: long-tail cut (`imbalance`) → public hold-out → partition → label-set mask (-1 for classes the
site does not annotate: `labelset:K`, the job's `identified` lists, or the site's `local/medflare_site.json`)
→ label noise → label fraction (the rest -1, unlabelled). Val/test labels stay clean; the public set has none.
Multi-label data takes the same path; only label noise, label fractions and "like_train" need single labels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from medflare.config import MAX_CLIENTS, MAX_IMAGE_SIZE, MAX_SEED, bounded, check_fields
from medflare.data.classes import align_to_job, left_out_classes
from medflare.data.longtail import long_tail_indices
from medflare.data.noise import NOISE_KINDS, inject_label_noise
from medflare.data.partition import Partition, apply_label_mask, parse_scheme, partition, partition_like
from medflare.data.public import check_public_options, hold_out_public, load_public_source
from medflare.data.readers import parse_window
from medflare.data.sources import load_source
from medflare.data.synthetic import apply_site_shift
from medflare.data.transforms import AUGMENTATIONS, build_transform
from medflare.data.types import UNLABELED, DataSplits, ImageSet, labelled_counts, labelled_rows
from medflare.errors import ConfigError, DataError

# Val/test slices are allowed to be small (or empty for tiny sources); only training needs min_size.
_EVAL_MIN_SIZE = 0
EVAL_SPLITS = ("pooled", "like_train")
MAX_SITE_SHIFT = 10.0  # acquisition-shift strength of in-memory demo sources


class ImageDataset(Dataset):
    """Torch dataset over an `ImageSet`: item i is (transformed float32 `[C, H, W]` tensor, label): an int
    (-1 = unlabelled), or for multi-label sets an int64 `[K]` tensor with -1 for unknown entries."""

    def __init__(self, images: ImageSet, transform: Callable[[np.ndarray], torch.Tensor]) -> None:
        self.images = images
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        return self.transform(self.images.get_image(index)), self.label(index)

    def label(self, index: int) -> int | torch.Tensor:
        """Sample `index`'s label: an int, or an int64 `[K]` tensor for multi-label sets."""
        value = self.images.labels[index]
        return torch.tensor(value) if self.images.multi_label else int(value)

    @property
    def labels(self) -> np.ndarray:
        """int64 `[N]` (or `[N, K]` multi-label) labels of this split (after masking and noise for training)."""
        return self.images.labels


class MultiViewDataset(Dataset):
    """Several transforms of one decoded image: item i is (float32 `[V, C, H, W]` views, label), e.g. FedLSM's
    weak (teacher) and strong (student) views."""

    def __init__(self, base: ImageDataset, transforms: list[Callable[[np.ndarray], torch.Tensor]]) -> None:
        if not transforms:
            raise ConfigError("MultiViewDataset needs at least one transform.")
        self.base = base
        self.transforms = transforms

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        image = self.base.images.get_image(index)
        return torch.stack([transform(image) for transform in self.transforms]), self.base.label(index)


@dataclass
class DataConfig:
    """Data settings of a job, identical on every site (simulation) or site-specific (local).

    Attributes:
        source: `load_source` spec. partition: scheme of the TRAIN split (`medflare.data.partition`).
        eval_split: "pooled" (stratified IID val/test) or "like_train" (each site's training class mix).
        seed: seed of the source, the partition and the label noise. image_size: None = the source's own.
        label_noise: flip rate μ of training labels ("symmetric" or "pairflip" `noise_kind`), or one per site.
        site_shift: acquisition-shift strength per site (in-memory sources only), 0 = none.
        local: POC/production: the source is this site's own data, used whole, no partitioning.
        min_size: smallest allowed training slice per site. num_classes: declared, checked against the data.
        public_fraction: simulation: seeded share of the training split held out, unlabelled, as the public set
            of public-set distillation methods. public_source: "images:DIR" or a `load_source` spec instead.
        label_fraction: share of each class's training labels a site keeps (SSL-FL), or one share per site.
        identified: classes each site annotates (simulation: one list per site, not with `labelset`; local:
            this site's list). None = every class.
        imbalance: largest/smallest training class ratio after a seeded long-tail cut (1 = keep everything).
        window: DICOM/NIfTI intensity window: "CENTER,WIDTH", a CT preset ("brain", "lung", ...), "file" (each
            DICOM's own) or "" (min-max per image).
        class_map: this site's class names -> the job's, or None to leave a class out (its
            `local/medflare_site.json`; `data.classes`).
        patient_column: a CSV manifest's column naming each image's patient, whose images then share one split
            ("": the `patient_id` column, when there is one; folders and DICOMs carry their own, see `load_source`).
    """

    source: str = bounded("synthetic", checked_by="load_source")
    partition: str = bounded("iid", checked_by="parse_scheme")
    eval_split: Literal["pooled", "like_train"] = "pooled"
    num_sites: int = bounded(2, low=1, high=MAX_CLIENTS)
    seed: int = bounded(0, low=0, high=MAX_SEED)
    image_size: int | None = bounded(None, low=1, high=MAX_IMAGE_SIZE)
    label_noise: float | list[float] = bounded(0.0, low=0, high=1, items=MAX_CLIENTS)
    noise_kind: str = bounded("symmetric", choices=NOISE_KINDS)
    site_shift: float = bounded(0.0, low=0, high=MAX_SITE_SHIFT)
    local: bool = False
    min_size: int = bounded(10, low=0, high=10**9)
    num_classes: int | None = bounded(None, low=2, high=100_000)
    augment: str = bounded("basic", choices=AUGMENTATIONS)
    public_fraction: float = bounded(0.0, low=0, high=1, high_open=True)
    public_source: str = bounded("", checked_by="check_public_options and the source's reader")
    label_fraction: float | list[float] = bounded(1.0, low=0, high=1, low_open=True, items=MAX_CLIENTS)
    identified: list | None = None
    imbalance: float = bounded(1.0, low=1, high=1e6)
    window: str = bounded("", checked_by="parse_window")
    class_map: dict[str, str | None] | None = bounded(None, checked_by="align_to_job (the job's class names)")
    patient_column: str = bounded("", checked_by="load_source (the CSV's header)")

    def __post_init__(self) -> None:
        check_fields(self, "data")  # the bounds of each option (Bound, in the field's metadata)
        parse_scheme(self.partition)  # fail early on a bad scheme string
        parse_window(self.window)
        rates = self.label_noise if isinstance(self.label_noise, list) else [self.label_noise]
        fractions = self.label_fraction if isinstance(self.label_fraction, list) else [self.label_fraction]
        checks = [
            (self.eval_split in EVAL_SPLITS, f"eval_split='{self.eval_split}' must be one of {EVAL_SPLITS}"),
            (not isinstance(self.label_noise, list) or len(rates) == self.num_sites,
             f"label_noise lists {len(rates)} rates for {self.num_sites} sites; give one rate per site"),
            (not isinstance(self.label_fraction, list) or len(fractions) == self.num_sites,
             f"label_fraction lists {len(fractions)} shares for {self.num_sites} sites; give one share per site"),
        ]
        problems = [message for ok, message in checks if not ok] + _identified_problems(self)
        problems += check_public_options(self.public_fraction, self.public_source, self.local)
        if problems:
            raise ConfigError("Invalid data config: " + "; ".join(problems) + ".")


@dataclass
class SiteData:
    """Everything a site trains and evaluates on. Train is augmented with its labels masked and noised; val,
    test and the unlabelled public set use the deterministic transform. `class_counts`: int64 `[K]` labelled
    training samples (multi-label: known positives); `identified`: bool `[K]` annotated classes, or None;
    `pooled_test` (simulation, on request): every site's test slice as that site sees it (FCA's
    generalization); `class_names`: in label order; `class_notes`: one line per job class the site lacks and per class it left out
    (`align_to_job`), for preflight's WARN rows and the site log."""

    train: ImageDataset
    val: ImageDataset
    test: ImageDataset
    num_classes: int
    channels: int
    image_size: int
    class_counts: np.ndarray
    identified: np.ndarray | None
    attributes_test: np.ndarray | None
    site_name: str
    public: ImageDataset | None = None
    multi_label: bool = False
    pooled_test: Dataset | None = None
    class_names: tuple[str, ...] = ()
    class_notes: tuple[str, ...] = ()


def make_site_data(cfg: DataConfig, site_index: int, site_name: str = "", pooled_test: bool = False,
                   class_names: Sequence[str] | None = None) -> SiteData:
    """The datasets of site `site_index` (0-based; ignored when local). `class_names`: the job's, in label order;
    data that names its classes must name these (`align_to_job`, with `cfg.class_map`).

    Raises:
        ConfigError: site index out of range, or a site shift on a file-based source.
        DataError: the source cannot be loaded, its class names are not the job's, or the training split is empty.
    """
    site_name = site_name or f"site-{site_index + 1}"
    # a job that names its classes counts them itself: a site may hold a subset (align_to_job checks the rest)
    splits = load_source(cfg.source, seed=cfg.seed, num_classes=None if class_names else cfg.num_classes,
                         left_out=left_out_classes(cfg.class_map),  # a class_map null: never read
                         patient_column=cfg.patient_column)
    splits = align_to_job(splits, class_names, cfg.class_map, site_name)
    train, val, test, identified = _site_sets(cfg, splits, site_index, site_name)
    train, val, test = (_as_seen(image_set, cfg, site_index) for image_set in (train, val, test))
    num_classes = splits.train.num_classes
    image_size = cfg.image_size or int(splits.info["image_size"])
    channels = splits.train.channels
    public = _public_set(cfg, splits, channels)
    return SiteData(
        train=ImageDataset(train, build_transform(channels, image_size, train=True, augment=cfg.augment)),
        val=ImageDataset(val, build_transform(channels, image_size, train=False)),
        test=ImageDataset(test, build_transform(channels, image_size, train=False)),
        num_classes=num_classes,
        channels=channels,
        image_size=image_size,
        class_counts=labelled_counts(train.labels, num_classes),
        identified=identified,
        attributes_test=test.attributes,
        site_name=site_name,
        public=None if public is None else ImageDataset(public, build_transform(channels, image_size, train=False)),
        multi_label=train.multi_label,
        pooled_test=_pooled_test(cfg, splits, channels, image_size) if pooled_test and not cfg.local else None,
        class_names=tuple(splits.info["class_names"]),
        class_notes=tuple(splits.info.get("class_notes", ())),
    )


def _as_seen(image_set: ImageSet, cfg: DataConfig, site_index: int) -> ImageSet:
    """A split as site `site_index` reads it: with the job's intensity window and that site's acquisition shift."""
    if cfg.window:
        image_set = _windowed(image_set, cfg)
    if cfg.site_shift > 0:
        image_set = _shifted(image_set, cfg, site_index)
    return image_set


def _pooled_test(cfg: DataConfig, splits: DataSplits, channels: int, image_size: int) -> Dataset:
    """Every simulated site's test slice as that site sees it, in site order (together the source's test split)."""
    transform = build_transform(channels, image_size, train=False)
    slices = [_as_seen(_site_sets(cfg, splits, index, f"site-{index + 1}")[2], cfg, index)
              for index in range(cfg.num_sites)]
    return ConcatDataset([ImageDataset(image_set, transform) for image_set in slices])


def describe_partition(cfg: DataConfig) -> list[dict]:
    """Per-site sizes, labelled training class counts and identified classes of a simulated split.

    Raises:
        ConfigError: `cfg.local` is True (a real site's data is not visible to whoever calls this).
    """
    if cfg.local:
        raise ConfigError("describe_partition is for simulation only; with local=True each site owns its data.")
    splits = load_source(cfg.source, seed=cfg.seed, num_classes=cfg.num_classes, patient_column=cfg.patient_column)
    num_classes = splits.train.num_classes
    summary = []
    for site_index in range(cfg.num_sites):
        train, val, test, identified = _site_sets(cfg, splits, site_index, f"site-{site_index + 1}")
        summary.append({
            "site": f"site-{site_index + 1}",
            "site_index": site_index,
            "n_train": len(train),
            "n_unlabeled": int((~labelled_rows(train.labels)).sum()),
            "n_val": len(val),
            "n_test": len(test),
            "class_counts": labelled_counts(train.labels, num_classes).tolist(),
            "identified": None if identified is None else identified.tolist(),
        })
    return summary


def _site_sets(cfg: DataConfig, splits: DataSplits, site_index: int,
               site_name: str) -> tuple[ImageSet, ImageSet, ImageSet, np.ndarray | None]:
    """This site's train/val/test sets (train labels masked and noised) and its identified-class mask."""
    num_classes = splits.train.num_classes
    if splits.train.multi_label and cfg.eval_split == "like_train":
        raise ConfigError("eval_split='like_train' follows each site's class mix, which needs single-label data; "
                          "use eval_split='pooled' for multi-label data.")
    train_all = _training_pool(cfg, splits)
    if cfg.local:
        train, val, test, identified = train_all, splits.val, splits.test, None
    else:
        if not 0 <= site_index < cfg.num_sites:
            raise ConfigError(f"Site '{site_name}' has index {site_index}, outside [0, {cfg.num_sites}); "
                              "check num_sites in the data config.")
        _, pool = hold_out_public(train_all, cfg.public_fraction, cfg.seed)  # sites never see the public share
        train_split = partition(pool.labels, cfg.num_sites, cfg.partition, seed=cfg.seed,
                                min_size=cfg.min_size, attributes=pool.attributes, num_classes=num_classes)
        train = pool.subset(train_split.indices[site_index])
        identified = None if train_split.identified is None else train_split.identified[site_index]
        val, test = (_eval_slice(image_set, cfg, site_index, train_split, pool.labels)
                     for image_set in (splits.val, splits.test))
    if len(train) == 0:
        raise DataError(f"Site '{site_name}' has no training samples in source '{cfg.source}'; give the site data, "
                        "or use fewer sites / another partition.")
    if cfg.identified is not None:
        identified = explicit_identified(cfg, site_index, num_classes)
    labels = train.labels if identified is None else apply_label_mask(train.labels, identified)
    rate = _per_site(cfg.label_noise, site_index)
    if rate > 0 and train.multi_label:
        raise ConfigError("label_noise flips class ids and needs single-label data; set label_noise to 0 for "
                          "multi-label data.")
    if rate > 0:
        labels = inject_label_noise(labels, num_classes, rate, cfg.noise_kind, seed=cfg.seed)
    fraction = _per_site(cfg.label_fraction, site_index)
    if fraction < 1.0 and train.multi_label:
        raise ConfigError("label_fraction keeps a share of each class's labels and needs single-label data; set "
                          "label_fraction to 1 for multi-label data (data.identified hides whole classes instead).")
    if fraction < 1.0:
        labels = keep_label_fraction(labels, fraction, seed=cfg.seed + site_index)
    if labels is not train.labels:
        train = dataclasses.replace(train, labels=labels)
    return train, val, test, identified


def _training_pool(cfg: DataConfig, splits: DataSplits) -> ImageSet:
    """The source's training split after the long-tail cut (``imbalance``): what the public hold-out and the
    partition both start from, so the public share stays disjoint from every site."""
    train = splits.train
    if cfg.imbalance <= 1.0:
        return train
    if train.multi_label:
        raise ConfigError("data.imbalance cuts classes to a long tail and needs single-label data; set imbalance "
                          "to 1 for multi-label data.")
    return train.subset(long_tail_indices(train.labels, train.num_classes, cfg.imbalance, cfg.seed))


def _public_set(cfg: DataConfig, splits: DataSplits, channels: int) -> ImageSet | None:
    """The unlabelled public set this config asks for (a held-out share, or a separate source), or None."""
    if cfg.public_source:
        return load_public_source(cfg.public_source, splits.train.num_classes, channels, cfg.seed)
    public, _ = hold_out_public(_training_pool(cfg, splits), cfg.public_fraction, cfg.seed)
    return public


def explicit_identified(cfg: DataConfig, site_index: int, num_classes: int) -> np.ndarray:
    """bool `[K]` of the classes this site annotates, from `cfg.identified` (its own list when local)."""
    classes = cfg.identified if cfg.local else cfg.identified[site_index]
    outside = [k for k in classes if not 0 <= k < num_classes]
    if outside:
        raise ConfigError(f"data.identified names class(es) {outside} outside [0, {num_classes}); use class ids of "
                          "the task.")
    mask = np.zeros(num_classes, dtype=bool)
    mask[list(classes)] = True
    return mask


def _identified_problems(cfg: DataConfig) -> list[str]:
    """What is wrong with `cfg.identified` (empty when it is valid or None)."""
    if cfg.identified is None:
        return []

    def is_class_list(value: object) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(k, int) and not isinstance(k, bool) for k in value)

    if cfg.local:
        ok = is_class_list(cfg.identified)
        return [] if ok else [f"identified={cfg.identified} must be a non-empty list of class ids for this site"]
    problems = []
    if not (isinstance(cfg.identified, list) and len(cfg.identified) == cfg.num_sites
            and all(is_class_list(site) for site in cfg.identified)):
        problems.append(f"identified must hold one non-empty list of class ids per site ({cfg.num_sites}), got "
                        f"{cfg.identified}")
    if parse_scheme(cfg.partition).kind == "labelset":
        problems.append("identified and a labelset partition both choose each site's classes; give only one")
    return problems


def _per_site(setting: float | list[float], site_index: int) -> float:
    """A setting given once or per site (a list): site `site_index`'s value."""
    return float(setting[site_index] if isinstance(setting, list) else setting)


def keep_label_fraction(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A copy of `labels` where each class keeps round(fraction x its count) labels (at least one), the others
    `UNLABELED`: stratified, as SSL-FL's 10/30/70 % runs. One seeded permutation per class, so a smaller
    fraction keeps a subset of a larger one's labels."""
    kept = np.full_like(labels, UNLABELED)
    rng = np.random.default_rng(seed)
    for label in np.unique(labels[labels != UNLABELED]):
        members = np.flatnonzero(labels == label)
        keep = max(1, int(round(fraction * len(members))))
        chosen = members[rng.permutation(len(members))[:keep]]
        kept[chosen] = label
    return kept


def _eval_slice(image_set: ImageSet, cfg: DataConfig, site_index: int, train_split: Partition,
                train_labels: np.ndarray) -> ImageSet:
    """This site's share of an evaluation split (`cfg.eval_split`); the shares of all sites tile the split."""
    if len(image_set) == 0:
        return image_set
    if cfg.eval_split == "like_train":
        mix = np.stack([np.bincount(train_labels[site], minlength=image_set.num_classes)
                        for site in train_split.indices])
        shares = partition_like(image_set.labels, mix, seed=cfg.seed)
    else:
        shares = partition(image_set.labels, cfg.num_sites, "iid", seed=cfg.seed, min_size=_EVAL_MIN_SIZE,
                           num_classes=image_set.num_classes)
    return image_set.subset(shares.indices[site_index])


def _windowed(image_set: ImageSet, cfg: DataConfig) -> ImageSet:
    if image_set.in_memory:
        raise ConfigError(f"data.window applies to image files, not to the in-memory source '{cfg.source}'; "
                          "remove data.window.")
    return dataclasses.replace(image_set, window=parse_window(cfg.window))


def _shifted(image_set: ImageSet, cfg: DataConfig, site_index: int) -> ImageSet:
    if not image_set.in_memory:
        raise ConfigError(f"site_shift needs an in-memory source (synthetic or medmnist), not '{cfg.source}'; "
                          "set site_shift to 0.")
    return dataclasses.replace(image_set, images=apply_site_shift(image_set.images, site_index, cfg.site_shift,
                                                                  cfg.seed))

