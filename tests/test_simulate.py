"""medflare's wrapper around FLARE's simulator: a site the simulator lost ends the run with a clear error, and a
job that is over (the server's runner finished, every site's END_RUN fired) does not wait out FLARE's shutdown
grace."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from medflare.console.processes import start_process
from medflare.console.simulate import LOST_SITE, SimulatorWatch, lost_site

# The line FLARE 2.9's simulator wrote when site-1's worker never connected (seen in a benchmark run).
LOST_LINE = ("2026-11-25 02:49:21,720 - SimulatorClientRunner - ERROR - Communication error with client site-1: "
             "[Errno 104] Connection reset by peer")
OTHER_ERROR = "2026-11-25 02:50:00,000 - ServerRunner - ERROR - site-2 returned EXECUTION_EXCEPTION for 'train'"
# What FLARE 2.9's simulator logged at the end of a job (server/log.txt, site-1/log.txt of a medflare run).
SERVER_ENDED = ("2026-11-26 07:56:16,287 - ServerRunner - INFO - [identity=simulator_server, run=simulate_job, "
                "wf=controller] - Server runner finished.")
SITE_ENDED = "2026-11-26 07:56:14,382 - ClientRunner - INFO - [identity=site-1, run=simulate_job] - END_RUN fired"
SITE_READINESS = ("2026-11-26 07:56:14,382 - ClientRunner - INFO - [identity=site-1, run=simulate_job] - Firing "
                  "CHECK_END_RUN_READINESS ...")


def test_lost_site_finds_flare_s_lost_site_lines_only(tmp_path: Path) -> None:
    log = tmp_path / "error_log.txt"
    assert lost_site(log) is None  # the simulator has not written it yet
    log.write_text(OTHER_ERROR + "\n")
    assert lost_site(log) is None  # a site's failed task is the controller's business, not a lost site
    log.write_text(f"{OTHER_ERROR}\n{LOST_LINE}\n")
    assert lost_site(log) == LOST_LINE
    died = "SimulatorClientRunner - ERROR - Subprocess died for client site-12, exit code: -9"
    assert LOST_SITE.search(died).group(1) == "site-12"


def idle_process() -> subprocess.Popen:
    return start_process([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_watch_stops_the_simulator_when_a_site_is_lost(tmp_path: Path) -> None:
    log, proc, started = tmp_path / "server" / "error_log.txt", idle_process(), time.monotonic()
    log.parent.mkdir()
    watch = SimulatorWatch(tmp_path, proc, sites=2, period_seconds=0.1)
    watch.start()
    log.write_text(OTHER_ERROR + "\n")
    time.sleep(0.5)
    assert proc.poll() is None and watch.reason is None  # other errors leave the run alone
    log.write_text(f"{OTHER_ERROR}\n{LOST_LINE}\n")
    watch.join(timeout=15)
    assert not watch.is_alive() and watch.reason == LOST_LINE and not watch.ended_job
    assert proc.poll() is not None and time.monotonic() - started < 15  # stopped, long before its own 60 s


def test_the_watch_ends_with_the_simulator(tmp_path: Path) -> None:
    proc = start_process([sys.executable, "-c", "pass"])
    watch = SimulatorWatch(tmp_path, proc, sites=2, period_seconds=0.1)
    watch.start()
    proc.wait()
    watch.join(timeout=5)
    assert not watch.is_alive() and watch.reason is None and not watch.ended_job


def append(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        log.write(line)


def test_the_watch_ends_flare_s_shutdown_grace_once_the_server_and_every_site_ended_the_run(tmp_path: Path) -> None:
    proc, started = idle_process(), time.monotonic()
    watch = SimulatorWatch(tmp_path, proc, sites=2, period_seconds=0.05)
    watch.start()
    append(tmp_path / "server" / "log.txt", SERVER_ENDED + "\n")
    append(tmp_path / "site-1" / "log.txt", SITE_ENDED + "\n")
    append(tmp_path / "site-2" / "log.txt", SITE_READINESS + "\n" + SITE_ENDED[:40])  # its END_RUN still running
    time.sleep(0.5)
    assert proc.poll() is None and not watch.ended_job  # site-2 may still be saving its state
    append(tmp_path / "site-2" / "log.txt", SITE_ENDED[40:] + "\n")  # the rest of the line it was writing
    watch.join(timeout=15)
    assert not watch.is_alive() and watch.ended_job and watch.reason is None
    assert proc.poll() is not None and time.monotonic() - started < 15  # ended by the watch, long before its 60 s
