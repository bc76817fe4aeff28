"""Fixtures of the data-layer tests: MD5-checked MedMNIST files and tiny PNG data sets written on the fly."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.data import clear_source_cache

# ../shared/data relative to the repository root (tests/data/conftest.py -> parents[2] is the root).
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MEDMNIST_MD5 = {
    "pneumoniamnist.npz": "28209eda62fecd6e6a2d98b1501bb15f",
    "retinamnist.npz": "bd4c0672f1bba3e3a89f0e4e876791e4",
    "breastmnist.npz": "750601b1f35ba3300ea97c75c52ff8f6",
}


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture(scope="session")
def medmnist_file() -> Callable[[str], Path]:
    """Returns a getter for a MedMNIST file of ../shared/data, skipping if absent and failing on a bad MD5."""
    checked: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in checked:
            path = SHARED_DATA / "medmnist" / name
            if not path.is_file():
                pytest.skip(f"{path} is absent: real-data tests need ../shared/data next to the repository "
                            "(see the project README); skipping.")
            actual = _md5(path)
            assert actual == MEDMNIST_MD5[name], (
                f"{path} has MD5 {actual}, expected {MEDMNIST_MD5[name]}: the file is corrupt or not the "
                "official MedMNIST v3.0.2 file; restore it."
            )
            checked[name] = path
        return checked[name]

    return get


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
