"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from medflare.data.checksums import MEDMNIST_MD5, file_md5

# ../shared/data beside the repository (tests/conftest.py -> parents[1] is the repository root).
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# the repository's own tools (tools/ is no package: job_templates, privacy_doc, mutants are imported by name)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


POC_MODULE = re.compile(r"(^|/)test_poc_[^/]*\.py$")
# modules whose parametrized cases all read one module-scoped fixture that is costly to build (every template's job,
# created by one nvflare process): their cases stay on one worker, so it is built once
SHARED_FIXTURE_MODULES = ("tests/deploy/test_templates.py",)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) when xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test``'s scheduling over its pytest-xdist workers (see :func:`work_unit`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every slow test (one that starts FLARE or trains for long) says where it runs: in ``make test``'s smoke set
    (``smoke``) or in ``make test-heavy`` (``heavy``), never both; a smoke or heavy test is also slow. A new
    end-to-end test must choose, so that ``make test`` keeps its time."""
    undecided = [item.nodeid for item in items
                 if bool(item.get_closest_marker("slow")) != (bool(item.get_closest_marker("smoke"))
                                                              + bool(item.get_closest_marker("heavy")) == 1)]
    if undecided:
        raise pytest.UsageError("a slow test must be marked either smoke (make test) or heavy (make test-heavy), and "
                                f"a smoke or heavy test slow; not so: {', '.join(undecided[:10])}")


def work_unit(nodeid: str) -> str:
    """The tests one worker runs together: every POC module (``test_poc_*.py``) as one unit, because POCs on one
    machine take turns on a lock and a second worker would sit idle waiting for it; a module's unparametrized tests
    as one unit, so its module-scoped fixtures (a whole simulator run, say) are built once; and each case of a
    parametrized test on its own, so the every-method runs spread over the workers, except in the modules of
    :data:`SHARED_FIXTURE_MODULES`."""
    module, _, test = nodeid.partition("::")
    if POC_MODULE.search(module):
        return "poc"
    return nodeid if "[" in test and not module.endswith(SHARED_FIXTURE_MODULES) else module


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (a really full disk); skipped unless this process may mount one (root in most CI images)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the patched-os.write tests cover a full disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


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
