"""A warm start for the Python processes FLARE's simulator starts for its sites, used by the test session only.

Why: every site of every simulator run is a fresh ``python -m nvflare.private.fed.app.simulator.simulator_worker``
that spends ~6 CPU-s importing torch, ``torch._dynamo`` (a torch optimizer's constructor imports it) and
torchvision before it does any work: on a 2-core CI machine that was a quarter of the suite's CPU. A POC's job
processes do the same, and ``nvflare job submit`` imports the job's components, torch with them (:data:`MODULES`,
:data:`SCRIPTS`). This server imports those libraries once and forks a child for each such process; the child then
runs the same module or script with the same arguments, environment, working directory, standard streams and
``sys.path`` a fresh interpreter would have.
Nothing of medflare, nvflare or the job is imported before the fork: the job's own code (a BYOC job's ``custom/``
included) is imported by the child from its own ``PYTHONPATH``, as in a cold start.

How (three processes per site worker):
- the stand-in: the process FLARE started. ``hook/sitecustomize.py`` sends its arguments, environment, working
  directory and file descriptors 0-2 here, forwards every signal it gets to the worker and exits with the worker's
  status (a signal as that signal), so FLARE's ``poll``, ``terminate`` and return codes see what they would see;
- the keeper: a fork of this server per request; it forks the worker, waits for it, reports how it ended, and kills
  it if the stand-in disappears (FLARE killed it with SIGKILL): no worker outlives its stand-in. Each keeper is
  its own process group: FLARE's job handles SIGKILL the process group of the pid they hold, also after that
  process ended (``ProcessAdapter.terminate``), and pids wrap (at 32768 here): in the server's group, a keeper that
  got such a pid would take the server and every other keeper with it;
- the worker: its own session (as FLARE's ``setsid``), default signal handlers, then ``runpy`` as ``python -m`` does;
  it dies with its keeper (``PR_SET_PDEATHSIG``).

Started by ``tests/conftest.py`` once per test process; ``MEDFLARE_TEST_WARM_START=0`` turns it off, and tests whose
subject is the processes themselves (signals, leftovers) start their runs cold (``cold_start`` fixture).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
from pathlib import Path

# what a site worker imports anyway, costly and free of per-run state; nothing of nvflare or medflare. With FLARE's
# modules preloaded too (tried: ~0.7 CPU-s a process less), workers that start that fast reach FLARE's simulator
# at the same instant, and its threads share one ``build_ctx`` whose ``client_name`` each sets just before sending
# it (``SimulatorRunner.do_one_task``), so site-2's worker once ran as site-1 (make test red, ldam-drw, 2026-11-28)
PRELOAD = ("numpy", "torch", "torch._dynamo", "torchvision")
# the ``python -m`` modules that start warm: FLARE's simulator as a recipe's SimEnv starts it, its site workers, and
# a POC's job processes (server and site; a POC's own server and site processes start cold, as do its ``nvflare``
# commands). Not the ``nvflare simulator`` command that ``medflare run`` starts: medflare stops it by killing its
# process tree (the simulator's multiprocessing manager included), and a warm process has no tree under its stand-in.
MODULES = ("nvflare.private.fed.app.simulator.simulator_worker", "nvflare.private.fed.app.simulator.simulator",
           "nvflare.private.fed.app.server.runner_process", "nvflare.private.fed.app.client.worker_process")
# the scripts that start warm, with their first argument: FLARE's admin commands that start no process (``nvflare job
# submit`` imports the job's components, torch with them, to fill in their defaults). Not ``nvflare poc``: it starts
# and stops the POC's processes, which medflare ties to its own (a keeper).
SCRIPTS = ("nvflare job", "nvflare system")
KILL_GRACE = 5.0
PR_SET_PDEATHSIG = 1
HOOK = Path(__file__).resolve().parent / "hook"  # put on the test session's PYTHONPATH: its sitecustomize hands over
LOG = os.devnull  # serve() sets it: server.log beside the socket


def receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The stand-in's request and its descriptors 0-2."""
    data, fds, _flags, _address = socket.recv_fds(conn, 1 << 20, 3)
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise EOFError("the stand-in closed its request early")
        body += more
    return json.loads(body), fds


def fresh_sys_path(first: str, env: dict[str, str]) -> list[str]:
    """``sys.path`` of a fresh interpreter whose first entry is ``first`` (``python -m``: its working directory; a
    script: the script's folder) with ``env``'s PYTHONPATH (the interpreter's and site's own entries kept)."""
    own = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    base = [entry for entry in sys.path[1:] if entry not in own]
    return [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), *base]


def run_worker(request: dict, fds: list[int], keeper: int) -> None:
    """Become the worker: ``python -m <module> <args>`` or ``python <script> <args>`` as a fresh interpreter would
    run it; never returns. It dies with its keeper, which reports to its stand-in: a worker no stand-in waits for
    would be left behind."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != keeper:  # the keeper died before the line above
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request.get("script")
    sys.path[:] = fresh_sys_path(os.path.dirname(os.path.realpath(script)) if script else request["cwd"],
                                 request["env"])
    if request["env"].get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    sys.argv = [script, *request["args"]] if script else ["-m", *request["args"]]
    sys.modules["__main__"] = types.ModuleType("__main__")
    import runpy

    code, interrupted = 0, False
    try:
        if script:
            runpy.run_path(script, run_name="__main__")  # what `python <script>` does
        else:
            runpy._run_module_as_main(request["module"], alter_argv=True)  # what `python -m` calls
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, (int, type(None))):
            print(end.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter prints it, then ends by SIGINT itself
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it, exit status 1 as it gives
        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's own end: non-daemon threads, then atexit, then the streams
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def hook_place() -> dict:
    """This server's place, by the hook's own ``place()`` (loaded from its file: the workers' ``sys.path`` is built
    from this process's and must not gain the hook's folder)."""
    spec = importlib.util.spec_from_file_location("medflare_warm_place", HOOK / "medflare_warm_place.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.place()


def keep(conn: socket.socket, own_place: dict) -> None:
    """The keeper: fork the worker, report its pid and how it ended; kill it if the stand-in goes away. A stand-in
    of another interpreter (virtual environment), in another network or mount namespace, or of another user, is told
    to start cold: a fork of this server would run outside them (a rehearsal's hospital, ``ip netns exec``, would
    reach the wrong network)."""
    request, fds = receive_request(conn)
    if request.get("place") != own_place:
        log(f"cold: {request.get('place')} is not {own_place}")
        send_cold(conn, fds)
    try:
        worker = os.fork()
    except OSError as error:
        log(f"cold: fork failed: {error}")
        send_cold(conn, fds)
    if worker == 0:
        conn.close()
        run_worker(request, fds, os.getppid())
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"{worker}\n".encode())
    except OSError:  # the stand-in is already gone
        stop(worker)
        os._exit(0)
    while True:
        done, status = os.waitpid(worker, os.WNOHANG)
        if done:
            ended = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
            try:
                conn.sendall(f"{ended}\n".encode())
            except OSError:
                pass
            os._exit(0)
        readable, _, _ = select.select([conn], [], [], 0.2)
        if readable and not stand_in_alive(conn):  # the stand-in is gone (SIGKILL): its worker goes too
            stop(worker)
            os._exit(0)


def send_cold(conn: socket.socket, fds: list[int]) -> None:
    """Tell the stand-in to start cold itself; ends the keeper."""
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):
        conn.sendall(b"cold\n")
    os._exit(0)


def log(line: str) -> None:
    """One line in the server's log beside its socket (what the warm start's tests show when a start went cold)."""
    with contextlib.suppress(OSError), open(LOG, "a") as out:
        out.write(f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {line}\n")


def stand_in_alive(conn: socket.socket) -> bool:
    """False once the stand-in's end is closed: end of stream, or a reset when it died before reading our reply."""
    try:
        return bool(conn.recv(1))
    except OSError:
        return False


def stop(worker: int) -> None:
    """SIGTERM, then SIGKILL after the grace (not medflare.processes: nothing of medflare is imported before a fork)."""
    os.kill(worker, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE
    while time.monotonic() < deadline:
        if os.waitpid(worker, os.WNOHANG)[0]:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)


def reap() -> None:
    """Wait for the keepers that ended: their and their workers' CPU time then counts in this process's children
    (what ``time`` and ``getrusage`` report for the test session), as a cold start's would."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def serve(address: str, owner: int) -> None:
    """Accept stand-ins until the owner (the test process) is gone."""
    global LOG
    LOG = os.path.join(os.path.dirname(address), "server.log")
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the children's collections then leave the preloaded objects' pages shared (not copied on write)
    own_place = hook_place()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    while os.getppid() == owner:
        reap()
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        try:
            conn, _ = listener.accept()
        except OSError as error:
            log(f"accept failed: {error}")
            continue
        try:
            keeper = os.fork()
        except OSError as error:  # the stand-in reads the end of its stream and starts cold
            log(f"cold: fork of a keeper failed: {error}")
            keeper = -1
        if keeper > 0:
            with contextlib.suppress(OSError):  # also here, so that it holds before the keeper runs
                os.setpgid(keeper, keeper)
        if keeper == 0:
            os.setpgid(0, 0)  # not in this server's process group (see the module's docstring)
            listener.close()
            code = 0
            try:
                keep(conn, own_place)
            except BaseException:  # noqa: BLE001 - a keeper's stand-in starts cold, a worker's ends with 1
                log(f"keeper or worker failed: {traceback.format_exc()}")
                code = 1
            finally:
                os._exit(code)
        conn.close()
    for path in (address, LOG):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    os.rmdir(os.path.dirname(address))  # the folder the test session made for this socket alone


if __name__ == "__main__":
    try:
        serve(sys.argv[1], int(sys.argv[2]))
    except BaseException:
        log(f"the server failed: {traceback.format_exc()}")
        raise
