"""A POC run that failed (say its output pipe closed when the terminal went away) still stops its POC when a stop
request arrives during that clean-up: the request must not cut the clean-up short and leave FLARE running.
A POC that fails while the network is down (``nvflare poc stop`` hangs) prints its real cause first, ends its own
processes and keeps ``<out>.failed.log``; one that does not start in time says what each participant last
logged. A POC that ``run_poc`` started dies with medflare, even on SIGKILL. One
medflare process at a time works on a POC root.

Fast: the POC session (or FLARE's ``nvflare`` command) is a stand-in, so this runs without FLARE;
test_poc_interrupt.py runs the real one."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

import medflare.console.deploy.poc as poc_module
from medflare.console.deploy.poc import PocError, PocSession
from medflare.console.processes import Interrupted, signals_held, stop_on_signals
from medflare.plan import resolve
from medflare.run_config import merge_run_config

from .._processes import kill_all, left_after, processes_naming


class PocThatFailsThenIsAskedToStop:
    """Starts by failing; its clean-up receives SIGTERM half-way, as from a supervisor stopping the run."""

    stopped: list[str] = []

    def __init__(self, root: Path, port: int, echo, tied: bool = False) -> None:
        self.root, self.echo, self.state = root, echo, {}

    @contextlib.contextmanager
    def hold(self):
        yield

    def prepare(self, clients: int, allow_job_data: bool, he: bool = False) -> None:
        self.state = {"sites": [f"site-{i + 1}" for i in range(clients)]}

    def start(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")  # the terminal that started the run is gone

    def server_log(self) -> str:
        return "server log\n"

    def discard(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the stop request arrives while the POC is being stopped
        self.stopped.append("poc stopped")


def test_a_stop_request_during_clean_up_does_not_leave_the_poc_running(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(poc_module, "PocSession", PocThatFailsThenIsAskedToStop)
    PocThatFailsThenIsAskedToStop.stopped = []
    run = merge_run_config({"method": "fedavg", "rounds": 1, "clients": 2, "data": {"source": "synthetic:n=60"}})
    out = tmp_path / "out"
    try:
        with stop_on_signals():
            poc_module.run_poc(resolve(run, "byoc", deployed=True), out, echo=lambda line: None)
    except Interrupted:  # a KeyboardInterrupt would end the whole pytest session: report it as this test's failure
        pytest.fail("the stop request cut the clean-up short")
    except BrokenPipeError:
        pass  # the original failure is what the caller sees
    else:
        pytest.fail("run_poc returned although its POC failed to start")
    assert PocThatFailsThenIsAskedToStop.stopped == ["poc stopped"]
    assert (tmp_path / "out.failed.log").read_text().startswith("server log")
    assert not (tmp_path / "out.partial").exists()


def test_signals_work_again_after_the_clean_up(tmp_path: Path) -> None:
    with pytest.raises(Interrupted):
        with stop_on_signals():
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)  # ignored here
            os.kill(os.getpid(), signal.SIGTERM)  # and honoured again once the clean-up is over


# A stand-in for FLARE's ``nvflare`` command while the network is down: ``poc start`` leaves a server and a site
# loop running (in sessions of their own, naming the POC workspace, as start.sh leaves sub_start.sh), a submission
# times out, and ``poc stop`` (which talks to the server) hangs.
FAKE_NVFLARE = textwrap.dedent("""
    import json, os, subprocess, sys, time
    args, workspace = sys.argv[1:], os.environ["NVFLARE_POC_WORKSPACE"]
    if args[:2] == ["poc", "start"]:
        for name in ("server", "site-1"):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"{workspace}/{name}/sub_start.sh"],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(json.dumps({"status": "ok"}))
    elif args[:2] == ["job", "submit"]:
        print(json.dumps({"status": "error", "message": "connection to the server timed out"}))
        sys.exit(1)
    elif args[:2] == ["poc", "stop"]:
        time.sleep(600)
""")
STOP_TIMEOUT = 2.0


class QuickStopSession(PocSession):
    """A real session whose ``nvflare poc stop`` is given seconds, not minutes, before the POC is ended directly."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stop_timeout = STOP_TIMEOUT

    def prepare(self, n_sites: int = 2, *args, **kwargs) -> None:  # what a provisioned POC leaves behind
        self.workspace.mkdir(parents=True)
        self.state = {"project": "p", "server": "server", "lead": "lead@x", "sites": ["site-1", "site-2"],
                      "jobs": {}}
        self.kit("server").mkdir(parents=True)
        (self.kit("server") / "log.txt").write_text("server log\n")


@pytest.fixture
def offline_flare(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "nvflare.py"
    script.write_text(FAKE_NVFLARE)
    monkeypatch.setattr(poc_module, "nvflare_command", lambda: [sys.executable, str(script)])
    monkeypatch.setattr(poc_module, "PocSession", QuickStopSession)


def test_a_poc_that_fails_offline_says_why_ends_its_processes_and_keeps_a_failed_log(
    tmp_path: Path, offline_flare
) -> None:
    run = merge_run_config({"method": "fedavg", "rounds": 3, "clients": 2, "data": {"source": "synthetic:n=60"}})
    out, lines, started = tmp_path / "out", [], time.monotonic()
    workspace = tmp_path / "out.partial" / "poc" / "poc"
    try:
        with pytest.raises(PocError, match="connection to the server timed out"):  # the cause, not the stop
            poc_module.run_poc(resolve(run, "byoc", deployed=True), out, echo=lines.append)
        assert time.monotonic() - started < 30  # the POC is discarded without its (hung) orderly stop
        assert left_after(workspace, seconds=5) == []  # the server and the site loop are ended
        failed = [i for i, line in enumerate(lines) if "failed:" in line]
        assert failed and "connection to the server timed out" in lines[failed[0]], lines
        assert not any("'nvflare poc stop'" in line for line in lines), lines
        assert sorted(p.name for p in tmp_path.iterdir()) == ["nvflare.py", "out.failed.log"]
        log = (tmp_path / "out.failed.log").read_text()
        assert log.startswith("server log") and "connection to the server timed out" in log
    finally:
        kill_all(processes_naming(workspace))


def test_a_hung_poc_stop_still_ends_the_poc_of_a_step_by_step_session(tmp_path: Path, offline_flare) -> None:
    session = QuickStopSession(tmp_path / "root", echo=lambda line: None)  # not tied: its POC outlives commands
    try:
        session.prepare()
        session.start()
        assert len(processes_naming(session.workspace)) == 2
        session.stop()  # returns: a POC that will not stop is no error of its own
        assert left_after(session.workspace, seconds=5) == []
    finally:
        kill_all(processes_naming(session.workspace))


class PocThatDoesNotStartInTime(QuickStopSession):
    """A POC whose ``nvflare poc start`` outlives its limit: the server logged, site-1 logged, site-2 never did."""

    def nvflare(self, *args: str, **kwargs) -> dict:
        if args[:2] == ("poc", "start"):
            raise PocError("'nvflare poc start' did not finish within 180 s")
        return {"status": "ok"}


def test_a_poc_that_does_not_start_in_time_says_what_each_participant_last_logged(tmp_path: Path) -> None:
    session = PocThatDoesNotStartInTime(tmp_path / "root", echo=lambda line: None)
    session.prepare()
    (session.kit("server") / "log.txt").write_text("started\nwaiting for site-2 to register\n")
    (session.kit("site-1") / "log.txt").parent.mkdir(parents=True)
    (session.kit("site-1") / "log.txt").write_text("connecting to server:8002 failed: certificate name mismatch\n")
    with pytest.raises(PocError) as failure:
        session.start()
    message = str(failure.value)
    assert "\n" not in message and message.startswith("'nvflare poc start' did not finish within 180 s")
    assert "server: 'waiting for site-2 to register'" in message
    assert "site-1: 'connecting to server:8002 failed: certificate name mismatch'" in message
    assert "site-2: no log" in message and f"{session.prod_dir()}/*/log.txt" in message


# A medflare that starts a tied POC (its ``poc start`` leaves a server running in a session of its own) and waits.
TIED_POC = textwrap.dedent("""
    import sys, time
    from medflare.console.deploy import poc
    marker = sys.argv[1]
    start = [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
             f"'import time; time.sleep(600)', '{marker}'], start_new_session=True)"]
    poc.nvflare_command = lambda: start
    session = poc.PocSession(marker, tied=True)
    session.state = {"project": "p"}
    session.nvflare("poc", "start", starts=True, check=False)
    print("started", flush=True)
    time.sleep(600)
""")


def test_a_tied_poc_dies_with_a_sigkilled_medflare(tmp_path: Path) -> None:
    from .._processes import LiveProcess

    marker = tmp_path / "poc-root"
    try:
        with LiveProcess([sys.executable, "-c", TIED_POC, str(marker)]) as medflare:
            medflare.wait_for("started", timeout=60)
            assert len(processes_naming(marker)) >= 1  # the "server", adopted by medflare's keeper
            medflare.proc.kill()
            medflare.proc.wait(timeout=10)
        assert left_after(marker, seconds=5) == []
    finally:
        kill_all(processes_naming(marker))


def test_one_medflare_at_a_time_on_a_poc_root(tmp_path: Path, capsys) -> None:
    root = tmp_path / "poc"
    with PocSession(root).hold():
        with pytest.raises(PocError, match=f"in use by medflare process {os.getpid()}"):
            with PocSession(root).hold():
                pass
        assert poc_module.main(["--root", str(root), "stop"]) == 2  # the step-by-step command line too
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"in use by medflare process {os.getpid()}" in error
    with PocSession(root).hold():  # free again once its holder is done
        pass
