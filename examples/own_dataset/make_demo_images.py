"""Write a small folder for the ``lesions`` example: grey PNGs of two classes and their ``labels.tsv``.

    python examples/own_dataset/make_demo_images.py runs/lesions-demo [--per-class 60]

A "malignant" image holds a larger, brighter disk than a "benign" one, on noise; 70 % of each class is train,
15 % val, 15 % test. Seeded: the same folder every time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("benign", "malignant")
SPLIT_SHARES = (("train", 0.70), ("val", 0.15))  # the rest is test
SIDE = 48


def lesion_image(rng: np.random.Generator, label: int) -> np.ndarray:
    """A uint8 ``[SIDE, SIDE]`` image: noise plus a disk whose size and brightness grow with ``label``."""
    rows, cols = np.mgrid[:SIDE, :SIDE]
    centre = rng.uniform(SIDE * 0.3, SIDE * 0.7, size=2)
    radius = rng.uniform(4, 8) + 6 * label
    disk = (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2 <= radius**2
    pixels = rng.normal(60, 20, size=(SIDE, SIDE)) + disk * (80 + 60 * label)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def split_of(position: int, count: int) -> str:
    """The split of the ``position``-th of ``count`` images of one class."""
    start = 0.0
    for split, share in SPLIT_SHARES:
        if position < round((start + share) * count):
            return split
        start += share
    return "test"


def write_demo(folder: Path, per_class: int, seed: int = 0) -> Path:
    """Write the images and ``labels.tsv`` into ``folder``; return the index file."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["file\tdiagnosis\tsplit"]
    for label, diagnosis in enumerate(CLASSES):
        for position in range(per_class):
            name = f"{diagnosis}_{position:04d}.png"
            Image.fromarray(lesion_image(rng, label)).save(folder / name)
            rows.append(f"{name}\t{diagnosis}\t{split_of(position, per_class)}")
    index = folder / "labels.tsv"
    index.write_text("\n".join(rows) + "\n")
    return index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--per-class", type=int, default=60, help="images per class (default 60)")
    args = parser.parse_args()
    index = write_demo(args.folder, args.per_class)
    print(f"wrote {2 * args.per_class} images and {index}; use --data lesions:{args.folder.resolve()}")


if __name__ == "__main__":
    main()
