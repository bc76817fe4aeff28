"""Data layer of medflare: sources, simulated federated partitions, label noise, transforms and per-site data.

Pure numpy/torch, usable without FLARE. Typical use on a site::

    cfg = DataConfig(source="synthetic:imbalance=20", partition="dirichlet:0.5", num_sites=4)
    site = make_site_data(cfg, site_index=0)
"""

from medflare.data.noise import inject_label_noise, noise_transition_matrix
from medflare.data.partition import Partition, apply_label_mask, parse_scheme, partition, partition_like
from medflare.data.site import (
    DataConfig,
    ImageDataset,
    MultiViewDataset,
    SiteData,
    describe_partition,
    make_site_data,
)
from medflare.data.sources import clear_source_cache, load_source
from medflare.data.synthetic import SyntheticConfig, apply_site_shift
from medflare.data.transforms import build_transform
from medflare.data.types import UNLABELED, DataSplits, ImageSet, labelled_counts, labelled_rows

__all__ = [
    "UNLABELED",
    "DataConfig",
    "DataSplits",
    "ImageDataset",
    "ImageSet",
    "MultiViewDataset",
    "Partition",
    "SiteData",
    "SyntheticConfig",
    "apply_label_mask",
    "apply_site_shift",
    "build_transform",
    "clear_source_cache",
    "describe_partition",
    "inject_label_noise",
    "labelled_counts",
    "labelled_rows",
    "load_source",
    "make_site_data",
    "noise_transition_matrix",
    "parse_scheme",
    "partition",
    "partition_like",
]
