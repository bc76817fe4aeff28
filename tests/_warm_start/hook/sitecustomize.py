"""Run by every Python process whose PYTHONPATH holds this folder (the test session puts it there; see
tests/_warm_start/server.py). A ``python -m`` process of a module the session names (FLARE's simulator and its site
workers, a POC's job processes), or of a script it names (``nvflare job``), hands its work to the warm server, which
forks a child that already has torch imported; this process stays as the worker's stand-in (the pid FLARE watches,
signals and waits for) and exits as the worker exits. Any other process, or any failure to reach the server, goes on
as a normal cold start."""

import os
import sys


def _hand_over() -> None:
    os.environ.pop("MEDFLARE_TEST_WARM_COLD", None)  # a cold parent's reason is not this process's
    address = os.environ.get("MEDFLARE_TEST_WARM_SERVER")
    what = _wanted(getattr(sys, "orig_argv", []))  # Python >= 3.10; any other interpreter that reads this starts cold
    if not address or not what:
        return
    import json
    import signal
    import socket

    try:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(address)
    except OSError as error:
        _started_cold(f"no server at {address}: {error}")  # the session ended or it is disabled
        return
    from medflare_warm_place import place  # beside this file

    request = json.dumps({**what, "cwd": os.getcwd(), "env": dict(os.environ), "place": place()}).encode()
    try:
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
        reply = conn.makefile("r")
        worker = int(reply.readline())
    except (OSError, ValueError) as error:
        conn.close()
        _started_cold(f"the server answered {error}")  # it could not fork, or it runs elsewhere (a namespace)
        return
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, lambda received, _frame: os.kill(worker, received))
    kind, value = reply.readline().split() or _keeper_gone(address, worker)  # a failed run
    if kind == "signal":  # end as the worker ended, so FLARE reads the same return code
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    os._exit(int(value))


def _started_cold(why: str) -> None:
    """Say why in this process's environment (the warm start's tests print it; a cold start does the same work)."""
    os.environ["MEDFLARE_TEST_WARM_COLD"] = why


def _keeper_gone(address: str, worker: int) -> list[str]:
    """The keeper ended without a word (SIGKILLed): note it in the server's log, and end as a failed run."""
    try:
        with open(os.path.join(os.path.dirname(address), "server.log"), "a") as log:
            log.write(f"stand-in {os.getpid()} of worker {worker} {sys.orig_argv[1:4]}: its keeper vanished\n")
    except OSError:
        pass
    return ["exit", "1"]


def _wanted(argv: list[str]) -> dict | None:
    """What to run warm: ``python -m MODULE ARGS`` of a module the session names, or ``python SCRIPT ARGS`` of a
    script (a console script, such as ``nvflare``) the session names with its first argument ("nvflare job")."""
    if len(argv) < 3:
        return None
    if argv[1] == "-m":
        return {"module": argv[2], "args": argv[3:]} if argv[2] in os.environ.get("MEDFLARE_TEST_WARM_MODULES",
                                                                                    "").split(",") else None
    scripts = os.environ.get("MEDFLARE_TEST_WARM_SCRIPTS", "").split(",")
    if f"{os.path.basename(argv[1])} {argv[2]}" in scripts and os.path.isfile(argv[1]):
        return {"script": argv[1], "args": argv[2:]}  # as given: the worker runs in the same working directory
    return None


_hand_over()
