"""Fixtures shared by every test folder."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from medflare.data.checksums import MEDMNIST_MD5, file_md5

# ../shared/data beside the repository (tests/conftest.py -> parents[1] is the repository root).
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# the warm start of FLARE's simulator processes (a helper folder, not a package on sys.path: loaded by its path)
_spec = importlib.util.spec_from_file_location("warm_start", Path(__file__).parent / "_warm_start" / "server.py")
warm_start = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(warm_start)
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


@pytest.fixture(scope="session", autouse=True)
def warm_site_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """FLARE's simulator and its site workers start as forks of a process that has torch imported
    (tests/_warm_start/server.py: why, and what stays as a cold start has it); ``MEDFLARE_TEST_WARM_START=0`` turns
    it off, and a session without slow tests (the simulator runs) does without."""
    wanted = any(item.get_closest_marker("slow") for item in request.session.items)
    if not wanted or os.environ.get("MEDFLARE_TEST_WARM_START", "1") == "0":
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="medflare-warm-"))  # short: a socket's path has at most 107 bytes
    address = folder / "server.sock"
    server = subprocess.Popen([sys.executable, warm_start.__file__, str(address), str(os.getpid())],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        with pytest.MonkeyPatch.context() as patch:  # the session's processes inherit these; restored at its end
            patch.setenv("MEDFLARE_TEST_WARM_SERVER", str(address))  # until it listens, the workers start cold
            patch.setenv("MEDFLARE_TEST_WARM_MODULES", ",".join(warm_start.MODULES))
            patch.setenv("MEDFLARE_TEST_WARM_SCRIPTS", ",".join(warm_start.SCRIPTS))
            patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                     str(warm_start.HOOK)])))
            yield
    finally:
        if server.poll() is not None:  # the session's simulator and POC runs went on cold: say so, with its log
            log = folder / "server.log"
            warnings.warn(f"the warm-start server ended early (exit status {server.returncode}); its log: "
                          f"{log.read_text()[-2000:] if log.exists() else 'empty'}", stacklevel=1)
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cold_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes this test starts begin as fresh interpreters (for tests whose subject is the processes)."""
    monkeypatch.delenv("MEDFLARE_TEST_WARM_SERVER", raising=False)


@pytest.fixture(scope="module")
def cold_start_module() -> Iterator[None]:
    """:func:`cold_start` for a module's fixtures too (a POC whose processes a test kills, say)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MEDFLARE_TEST_WARM_SERVER", raising=False)
        yield


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
