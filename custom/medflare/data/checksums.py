"""MD5 sums of the official MedMNIST files, so tests and benchmarks never trust a corrupt copy."""

from __future__ import annotations

import hashlib
from pathlib import Path

from medflare.errors import DataError

# The MD5 field of medmnist/info.py, MedMNIST v3.0.2 (28 px files).
MEDMNIST_MD5 = {
    "pneumoniamnist.npz": "28209eda62fecd6e6a2d98b1501bb15f",
    "retinamnist.npz": "bd4c0672f1bba3e3a89f0e4e876791e4",
    "breastmnist.npz": "750601b1f35ba3300ea97c75c52ff8f6",
}


def file_md5(path: str | Path) -> str:
    """Hex MD5 of a file, read in 1 MiB blocks."""
    digest = hashlib.md5()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_medmnist_file(path: str | Path) -> Path:
    """Raise DataError unless ``path`` is a known MedMNIST file with the official MD5."""
    file = Path(path)
    expected = MEDMNIST_MD5.get(file.name)
    if expected is None:
        raise DataError(f"{file.name} is not one of the checked MedMNIST files {sorted(MEDMNIST_MD5)}")
    actual = file_md5(file)
    if actual != expected:
        raise DataError(f"{file} has MD5 {actual}, expected {expected}: the copy is corrupt; restore it")
    return file
