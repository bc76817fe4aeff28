"""Fixtures of the deployment tests: one FLARE POC at a time on this machine."""

from __future__ import annotations

import fcntl
import socket
import time
from collections.abc import Iterator

import pytest

POC_LOCK = "/tmp/medflare-poc.lock"  # shared by every POC test run and `flock` user on this machine
POC_LOCK_WAIT = 1200


@pytest.fixture(scope="module")
def poc_lock() -> Iterator[None]:
    """Hold the machine-wide POC lock for a module's POC (POCs on one host collide on ports and CPU)."""
    with open(POC_LOCK, "a") as handle:
        deadline = time.time() + POC_LOCK_WAIT
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    pytest.fail(
                        f"{POC_LOCK} stayed locked for {POC_LOCK_WAIT} s: another POC is running (if pytest itself "
                        "runs under `flock` on that file, run it without: the POC tests take the lock themselves)"
                    )
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def poc_port() -> int:
    """A TCP port nothing listens on right now (each module's POC gets its own)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
