"""The rehearsal's reaper: what ``medflare rehearse`` made is removed even when it is SIGKILLed.

SIGKILL cannot be caught, so the rehearsal starts this small process first (:func:`start_reaper`, before any
namespace exists) and holds the write end of a pipe to its stdin. The reaper blocks reading it; end of file means
the rehearsal closed it (it cleaned up itself: nothing is left to do) or died. Then the reaper removes exactly what
the rehearsal owns: the namespaces and ``/etc/netns`` folders named ``mfr-<its pid>-*``
(:func:`medflare.console.deploy.netns.sweep_owner`), every process inside them (its servers, sites, preflights and watch,
all started inside its namespaces; their qdiscs go with the namespaces), and the folders it names (the kits with
their private keys, and its home). Nothing else is touched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import medflare


def start_reaper(owner: int, folders: list[Path]) -> subprocess.Popen:
    """Start the reaper of the rehearsal of process ``owner`` (this process) and its ``folders``; close its
    ``stdin`` (:func:`stop_reaper`) once the rehearsal has cleaned up. It runs in a session of its own, so a signal
    to the rehearsal's process group leaves it to do its work."""
    package_root = str(Path(medflare.__file__).resolve().parents[1])  # this medflare, whatever the cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "medflare.console.deploy.reaper", "--owner", str(owner),
                             *map(str, folders)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, env=env)


def stop_reaper(reaper: subprocess.Popen, timeout: float = 60.0) -> None:
    """Tell the reaper the rehearsal is done (it sweeps what may be left, normally nothing) and wait for it."""
    if reaper.stdin is not None:
        reaper.stdin.close()
    try:
        reaper.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def reap(owner: int, folders: list[Path]) -> list[str]:
    """Remove what the rehearsal of process ``owner`` made: its namespaces with their processes and hosts folders,
    and ``folders``; return the namespaces removed."""
    from medflare.console.deploy.netns import sweep_owner

    removed = sweep_owner(owner)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def main(argv: list[str] | None = None) -> int:
    """The reaper process: wait for end of file on stdin, then :func:`reap`."""
    parser = argparse.ArgumentParser(description="remove a rehearsal's namespaces and kits once it is gone")
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("folders", type=Path, nargs="*")
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C is the rehearsal's to handle
        signal.signal(signum, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):
        pass
    removed = reap(args.owner, args.folders)
    if removed:
        print(f"rehearse: the reaper removed {', '.join(removed)} and their processes, left by a rehearsal that "
              "died", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
