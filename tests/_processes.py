"""Child processes for tests that interrupt medflare: await output lines, list descendants, send SIGTERM, find
what a killed medflare left behind."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


class LiveProcess:
    """A child whose output lines can be awaited without blocking forever."""

    def __init__(self, command: list[str], **popen_args) -> None:
        python_path = os.pathsep.join(filter(None, [str(REPO / "custom"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     **popen_args)
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.lines.append(line)
            if text in line:
                return
        raise AssertionError(f"'{text}' did not appear within {timeout:.0f} s:\n" + "".join(self.lines[-30:]))

    def __enter__(self) -> "LiveProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        """A test that failed early still stops medflare the way a user would (SIGTERM), then reaps it."""
        if self.proc.poll() is None:
            sigterm_and_wait(self, timeout=240)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)


def alive(processes: list[psutil.Process]) -> list[str]:
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(" ".join(process.cmdline())[:200])
        except psutil.NoSuchProcess:
            continue
    return running


def sigterm_and_wait(live: LiveProcess, timeout: float) -> int:
    live.proc.send_signal(signal.SIGTERM)
    try:
        return live.proc.wait(timeout=timeout)
    finally:
        if live.proc.poll() is None:
            live.proc.kill()


def processes_naming(path: Path) -> list[psutil.Process]:
    """Live processes whose command line names ``path`` (every process of a run names its folder)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(path) in " ".join(process.info["cmdline"] or []) and process.pid != os.getpid():
            found.append(process)
    return found


def left_after(path: Path, seconds: float) -> list[str]:
    """The command lines of processes naming ``path`` that are still alive ``seconds`` from now (or fewer)."""
    deadline = time.time() + seconds
    while (left := alive(processes_naming(path))) and time.time() < deadline:
        time.sleep(0.5)
    return left


def kill_all(processes: list[psutil.Process]) -> None:
    """SIGKILL what a test left behind (clean-up after a failed assertion, so later tests are not slowed)."""
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(processes, timeout=10)
