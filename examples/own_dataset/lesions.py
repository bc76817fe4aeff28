"""Your own ``Dataset`` and MONAI transforms as a medflare data source: ``--data lesions:/abs/path/to/folder``.

``LesionDataset`` stands for the dataset class a hospital already has: it reads its own index file
(``labels.tsv``: ``file<TAB>diagnosis<TAB>split``) and applies MONAI transforms to each image. The plugin
function turns its three splits into medflare's with ``splits_from_datasets``. This file is a plugin (BYOC);
for a pre-installed site, put it in a package with an entry point instead (docs/own-model-and-data.md).

    python examples/own_dataset/make_demo_images.py runs/lesions-demo
    medflare run fedavg --data "lesions:$PWD/runs/lesions-demo" \\
        --set 'plugins=["examples/own_dataset/lesions.py"]' --rounds 2 --max-steps 5

Give the folder as an absolute path: the plugin reads it as given, in each site's own working folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from monai.transforms import Compose, LoadImage, Resize, ScaleIntensity
from torch.utils.data import Dataset

from medflare.data import DataSplits
from medflare.data.plugins import register_source, splits_from_datasets
from medflare.errors import DataError

CLASSES = ("benign", "malignant")
INDEX_FILE = "labels.tsv"
IMAGE_SIDE = 32
# Deterministic preprocessing only: the source is read once into memory, and medflare adds its own per-epoch
# augmentation (data.augment) and normalisation to [-1, 1] afterwards.
PREPROCESS = Compose([
    LoadImage(image_only=True, ensure_channel_first=True),  # PNG -> [C, H, W]
    ScaleIntensity(),  # -> floats in [0, 1]
    Resize((IMAGE_SIDE, IMAGE_SIDE)),  # one size for every image
])


class LesionDataset(Dataset):
    """One split of the folder: items ``(image [C, H, W] in [0, 1], class id)``."""

    def __init__(self, root: Path, split: str, transform: Callable[[str], torch.Tensor]) -> None:
        rows = [line.split("\t") for line in (root / INDEX_FILE).read_text().splitlines()[1:] if line.strip()]
        self.items = [(root / file, CLASSES.index(diagnosis)) for file, diagnosis, part in rows if part == split]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[index]
        return self.transform(str(path)), label


@register_source("lesions")
def load_lesions(argument: str, seed: int) -> DataSplits:
    """The ``lesions:FOLDER`` source: the folder's train/val/test splits, as its index file assigns them."""
    del seed  # the index file fixes the splits
    root = Path(argument)
    if not (root / INDEX_FILE).is_file():
        raise DataError(f"lesions:{argument}: no {INDEX_FILE} there; give the absolute path of a folder made by "
                        "examples/own_dataset/make_demo_images.py")
    train, val, test = (LesionDataset(root, split, PREPROCESS) for split in ("train", "val", "test"))
    return splits_from_datasets(train, val, test, class_names=CLASSES)
