"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from medflare.data.checksums import MEDMNIST_MD5, file_md5

# ../shared/data beside the repository (tests/conftest.py -> parents[1] is the repository root).
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def medmnist_file() -> Callable[[str], Path]:
    """Getter for a MedMNIST file of ../shared/data: skips when absent, fails on a wrong MD5."""
    checked: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in checked:
            path = SHARED_DATA / "medmnist" / name
            if not path.is_file():
                pytest.skip(f"{path} is absent: real-data tests need ../shared/data next to the repository; skipping.")
            actual = file_md5(path)
            assert actual == MEDMNIST_MD5[name], (
                f"{path} has MD5 {actual}, expected {MEDMNIST_MD5[name]}: the file is corrupt; restore it."
            )
            checked[name] = path
        return checked[name]

    return get
