"""A POC run that failed (say its output pipe closed when the terminal went away) still stops its POC when a stop
request arrives during that clean-up: the request must not cut the clean-up short and leave FLARE running.

Fast: the POC session is a stand-in, so this runs without FLARE; test_poc_interrupt.py runs the real one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import medflare.deploy.poc as poc_module
from medflare.run_config import merge_run_config
from medflare.runner import Interrupted, signals_held, stop_on_signals


class PocThatFailsThenIsAskedToStop:
    """Starts by failing; its clean-up receives SIGTERM half-way, as from a supervisor stopping the run."""

    stopped: list[str] = []

    def __init__(self, root: Path, port: int, echo) -> None:
        self.root, self.echo, self.state = root, echo, {}

    def prepare(self, clients: int, allow_job_data: bool) -> None:
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
            poc_module.run_poc(run, out, echo=lambda line: None)
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
