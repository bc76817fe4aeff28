"""SIGTERM to ``medflare run --env poc`` mid-job: the POC's server and sites stop, nothing keeps listening, and
``<out>.failed.log`` remains. While it runs, the POC server listens on loopback only."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from .._processes import LiveProcess, alive, processes_naming, sigterm_and_wait


def listening_addresses(port: int) -> set[str]:
    """IPv4 addresses with a TCP socket in LISTEN state on ``port`` (from /proc/net/tcp)."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        host_hex, port_hex = fields[1].split(":")
        if fields[3] == "0A" and int(port_hex, 16) == port:
            addresses.add(socket.inet_ntoa(bytes.fromhex(host_hex)[::-1]))
    return addresses


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_sigterm_stops_the_poc_and_its_server_listens_on_loopback(
    tmp_path: Path, poc_lock, poc_port, monkeypatch
) -> None:
    monkeypatch.setenv("MEDFLARE_POC_PORT", str(poc_port))  # a free port: an earlier POC may still hold 8002
    out = tmp_path / "out"
    command = [sys.executable, "-m", "medflare.console.cli", "run", "fedavg", "--env", "poc", "--data", "synthetic:n=400",
               "--rounds", "40", "--max-steps", "3", "--out", str(out)]
    with LiveProcess(command) as live:
        live.wait_for("poc: waiting for job", timeout=300)
        poc_processes = processes_naming(tmp_path / "out.partial" / "poc")
        assert len(poc_processes) >= 3, "server and two sites should be running"
        assert listening_addresses(poc_port) == {"127.0.0.1"}

        code = sigterm_and_wait(live, timeout=240)

    assert code == 128 + signal.SIGTERM, "".join(live.lines[-20:])
    deadline = time.time() + 30
    while alive(poc_processes) and time.time() < deadline:
        time.sleep(1)
    assert alive(poc_processes) == []
    assert listening_addresses(poc_port) == set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.failed.log"]
    log = (tmp_path / "out.failed.log").read_text()
    assert "interrupted by SIGTERM" in log and "rounds finished:" in log
