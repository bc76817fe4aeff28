"""Child processes that die with medflare, even when medflare itself is SIGKILLed.

medflare starts FLARE's simulator and a POC's server and sites through a keeper: this file, run as a script. The
keeper is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every process below it stays below it even when it
starts a new session (FLARE's simulator workers call ``setsid``; a POC's ``start.sh`` leaves ``sub_start.sh`` loops
behind); when medflare dies (``PR_SET_PDEATHSIG``, checked against the parent pid, which it also polls) it ends
everything below it, and only that. This module imports nothing from medflare: the keeper runs it with ``python -I``
(no PYTHONPATH), so the environment it hands to FLARE is exactly medflare's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import psutil

KEEPER_SCRIPT = os.path.abspath(__file__)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PARENT_GONE = signal.SIGUSR1  # what the kernel sends the keeper when its parent dies
POLL_SECONDS = 0.2
GRACE_SECONDS = 10.0


def keeper_command(command: list[str], stay: bool = False, report_fd: int | None = None) -> list[str]:
    """``command`` run by a keeper that ends it, and all it started, when this process dies. ``stay``: keep what
    the command leaves running after it exits (a POC's server and sites; by default the keeper ends the leftovers
    and exits with the command's code). ``report_fd``: a descriptor (in ``pass_fds``) it writes the exit code to."""
    options = ["--parent", str(os.getpid())] + (["--stay"] if stay else [])
    options += ["--report-fd", str(report_fd)] if report_fd is not None else []
    return [sys.executable, "-I", KEEPER_SCRIPT, *options, "--", *command]


def start_kept(command: list[str], **popen_args: Any) -> subprocess.Popen:
    """Start ``command`` through a keeper in a new session (a terminal's Ctrl-C reaches medflare only).

    The returned process is the keeper: it exits with the command's code once nothing it started is left, and
    ending it (SIGTERM) ends everything below it."""
    return subprocess.Popen(keeper_command(command), start_new_session=True, **popen_args)


def run_kept(
    command: list[str], timeout: float, **popen_args: Any
) -> tuple[subprocess.CompletedProcess, subprocess.Popen]:
    """Run ``command`` to its end through a keeper that stays with whatever the command leaves running; return the
    command's result (text output) and the keeper, which lives on while those processes do (end it to end them).
    Output goes through files, not pipes: a daemon the command leaves behind could hold a pipe open forever. After
    ``timeout`` the keeper and all below it are ended and ``subprocess.TimeoutExpired`` raised."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, os.fdopen(read_fd) as report:
        try:
            keeper = subprocess.Popen(keeper_command(command, stay=True, report_fd=write_fd), stdout=out,
                                      stderr=err, pass_fds=(write_fd,), start_new_session=True, text=True,
                                      **popen_args)
        finally:
            os.close(write_fd)  # the keeper holds the only write end: end of file means it is gone
        ready, _, _ = select.select([report], [], [], timeout)
        if not ready:
            end_processes([keeper])
            raise subprocess.TimeoutExpired(command, timeout)
        code = report.readline().strip() or str(128 + signal.SIGTERM)  # the keeper was ended before the command
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, int(code), out.read(), err.read()), keeper


def end_processes(processes: list[subprocess.Popen | psutil.Process], grace_seconds: float = GRACE_SECONDS,
                  first: int = signal.SIGTERM) -> None:
    """Signal every process (``first``), SIGKILL those still alive after ``grace_seconds``, reap our own children."""
    targets = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            targets.append(process if isinstance(process, psutil.Process) else psutil.Process(process.pid))
    for process in targets:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(first)
    _, alive = psutil.wait_procs(targets, timeout=grace_seconds)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_seconds)
    for process in processes:
        if isinstance(process, subprocess.Popen):
            process.poll()  # reaped above by psutil; let Popen know


# ----- the keeper (this file run as a script) ---------------------------------------------------------------
def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


class Keeper:
    """Runs one command as a child subreaper and ends all below it when asked to or when its parent dies."""

    def __init__(self, parent: int, stay: bool, report_fd: int | None) -> None:
        self.parent, self.stay, self.report_fd = parent, stay, report_fd
        self.stop_signal: int | None = None
        self.code: int | None = None

    def run(self, command: list[str]) -> int:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, PARENT_GONE)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, PARENT_GONE):
            signal.signal(signum, self._on_signal)
        child = subprocess.Popen(command)
        while self.stop_signal is None and not self._parent_gone():
            self._reap(child.pid)
            if self.code is not None and not (self.stay and self._below()):
                break
            time.sleep(POLL_SECONDS)
        self._end_all_below()
        self._reap(child.pid)
        if self.code is None:  # stopped before the command ended
            return 128 + (self.stop_signal or signal.SIGTERM)
        return self.code

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A thread of the parent that exits also triggers PDEATHSIG: only a real reparenting counts.
        if signum != PARENT_GONE or self._parent_gone():
            self.stop_signal = signum

    def _parent_gone(self) -> bool:
        return os.getppid() != self.parent

    def _below(self) -> list[psutil.Process]:
        return psutil.Process().children(recursive=True)

    def _reap(self, child_pid: int) -> None:
        """Collect every exited child (adopted orphans included); note the command's exit code."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == child_pid:
                code = os.waitstatus_to_exitcode(status)
                self.code = code if code >= 0 else 128 - code
                self._report()

    def _report(self) -> None:
        if self.report_fd is not None:
            os.write(self.report_fd, f"{self.code}\n".encode())
            os.close(self.report_fd)
            self.report_fd = None

    def _end_all_below(self) -> None:
        """End every descendant; repeat, since a dying supervisor loop may start one more."""
        for _ in range(3):
            below = self._below()
            if not below:
                return
            end_processes(below, grace_seconds=GRACE_SECONDS / 2)


def main(argv: list[str]) -> int:
    """The keeper process: run a command and end everything it started when ``--parent`` dies."""
    parser = argparse.ArgumentParser(description="run a command; end all it started when the parent dies")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--stay", action="store_true")
    parser.add_argument("--report-fd", type=int)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return Keeper(args.parent, args.stay, args.report_fd).run(command)

# ----- the nvflare command and FLARE's admin side ------------------------------------------------------------------
def nvflare_command() -> list[str]:
    """The nvflare CLI of *this* interpreter's environment (never whatever is first on PATH)."""
    candidate = Path(sys.executable).with_name("nvflare")
    return [str(candidate)] if candidate.exists() else [sys.executable, "-m", "nvflare.cli"]


def nvflare_reply(done: subprocess.CompletedProcess) -> dict[str, Any]:
    """An ``nvflare ... --format json`` command's reply with its ``exit_code``: the last JSON object it printed (FLARE
    may print warnings before it), else an error with the end of its output."""
    for text in [*reversed(done.stdout.strip().splitlines()), done.stdout]:
        if text.strip().startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return {**json.loads(text), "exit_code": done.returncode}
    return {"status": "error", "message": (done.stderr or done.stdout)[-2000:], "exit_code": done.returncode}


# FLARE's admin side (the ``nvflare`` command, the Session API) looks for its optional comm_config.json in
# ConfigService's config path, which FLARE sets for its server and sites only; elsewhere it walks the whole working
# directory for it, once per file extension. From a source checkout with its .venv that cost ~3 CPU-s per command
# (2026-11-28), from a hospital's data share it could take minutes, and a stray comm_config.json anywhere below would
# configure FLARE's connections. medflare therefore runs those commands in a folder of its own
# (:func:`flare_admin_popen_args`) and gives its own admin sessions a config path (:func:`confine_flare_config_search`).
def flare_admin_popen_args(folder: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """``cwd`` and ``env`` for an ``nvflare`` admin command run in ``folder`` (created if missing): the environment's
    relative PYTHONPATH entries made absolute first, so the command imports what this process would."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(str(Path(entry).resolve()) if entry else entry
                                            for entry in env["PYTHONPATH"].split(os.pathsep))
    return {"cwd": str(folder), "env": env}


@contextlib.contextmanager
def flare_admin_command(folder: Path, env: Mapping[str, str]) -> Iterator[dict[str, Any]]:
    """:func:`flare_admin_popen_args` for one admin command that starts nothing, with ``TMPDIR`` a fresh folder
    under ``folder``, removed (with what is in it) when the command is done: FLARE's admin client zips every job it
    submits, signed, into the temporary folder and never deletes the zip (``nvflare/fuel/hci/client/
    file_transfer.py``), which would leave a copy of each job in the machine's /tmp."""
    args = flare_admin_popen_args(folder, env)
    scratch = Path(tempfile.mkdtemp(prefix="flare-admin-", dir=folder))
    try:
        yield {**args, "env": {**args["env"], "TMPDIR": str(scratch)}}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def confine_flare_config_search(folder: Path) -> None:
    """Make this process's FLARE look for its config files in ``folder`` (an admin kit) rather than walk the working
    directory (see :func:`flare_admin_popen_args`). A missing folder is left to the session to report."""
    from nvflare.fuel.utils.config_service import ConfigService

    if folder.is_dir():
        ConfigService.initialize(section_files={}, config_path=[str(folder)])


# ----- interruption ------------------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT (``signum``) arrived: every ``except BaseException`` clean-up path runs, as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def _stop_signals_handled_by(handler: Any) -> Iterator[None]:
    """SIGTERM/SIGINT go to ``handler`` within the block, the previous handlers after it. Only the main thread can
    own signal handlers; elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_on_signals() -> contextlib.AbstractContextManager[None]:
    """Within this block SIGTERM/SIGINT raise :class:`Interrupted` once; repeats are ignored so clean-up finishes."""
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not received:
            received.append(signum)
            raise Interrupted(signum)

    return _stop_signals_handled_by(handler)


def signals_held() -> contextlib.AbstractContextManager[None]:
    """Within this block SIGTERM/SIGINT are ignored: the clean-up of a run that already failed (say its output pipe
    closed) must finish even when a stop request arrives meanwhile, or the processes it was about to stop stay
    running."""
    return _stop_signals_handled_by(signal.SIG_IGN)


def quiet_on_closed_output(echo: Callable[[str], None]) -> Callable[[str], None]:
    """``echo`` that stays silent once its output is gone (a closed terminal or pipe), so clean-up runs on."""

    def write(line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            echo(line)

    return write


def start_process(command: list[str], **popen_args: Any) -> subprocess.Popen:
    """Start a child in its own process group, so a terminal's Ctrl-C reaches medflare only and medflare
    stops the child's whole tree itself (:func:`stop_process_tree`)."""
    return subprocess.Popen(command, start_new_session=True, **popen_args)


def stop_process_tree(proc: subprocess.Popen, grace_seconds: float = 10.0) -> None:
    """Terminate ``proc`` and every process below it (FLARE's simulator starts each site in a new session, so
    its process group alone is not enough); kill whatever outlives ``grace_seconds``."""
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        tree = root.children(recursive=True) + [root]
    end_processes(tree, grace_seconds)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
