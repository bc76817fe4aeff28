"""Fixtures of the data-layer tests: tiny PNG data sets written on the fly (MedMNIST files: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.data import clear_source_cache


@pytest.fixture(autouse=True)
def fresh_source_cache() -> None:
    """Each test starts with an empty `load_source` cache, so file-based sources are re-read."""
    clear_source_cache()


def write_png(path: Path, rng: np.random.Generator, channels: int = 1, size: int = 12) -> None:
    """Writes a small random PNG (grayscale or RGB)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (size, size) if channels == 1 else (size, size, 3)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)


@pytest.fixture
def png_class_folder(tmp_path: Path) -> Callable[..., Path]:
    """Returns a builder of `root/<class>/img_<i>.png` trees: `build(counts, channels=1, splits=False)`."""

    def build(counts: dict[str, int], channels: int = 1, splits: bool = False) -> Path:
        rng = np.random.default_rng(0)
        root = tmp_path / "images"
        for name, count in counts.items():
            for i in range(count):
                folder = root / (("train", "val", "test")[i % 3] if splits else "") / name
                write_png(folder / f"img_{i:03d}.png", rng, channels)
        return root

    return build


@pytest.fixture
def png_manifest(tmp_path: Path) -> Callable[..., Path]:
    """Returns a writer of a CSV manifest plus its PNGs: `write(rows, header)` with rows of column values.

    The `path` column is written relative to the CSV and the PNG is created unless its name contains
    "missing".
    """

    def write(rows: list[dict], header: tuple[str, ...] = ("path", "label")) -> Path:
        rng = np.random.default_rng(1)
        manifest = tmp_path / "manifest.csv"
        lines = [",".join(header)]
        for row in rows:
            if "missing" not in row["path"]:
                write_png(tmp_path / row["path"], rng)
            lines.append(",".join(str(row.get(column, "")) for column in header))
        manifest.write_text("\n".join(lines) + "\n")
        return manifest

    return write
