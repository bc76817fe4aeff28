"""Keep a long FLARE job's memory flat: free each round's reference cycles and free heap when the round ends.

FLARE's streaming layer (``nvflare.fuel.f3.streaming``: ``TxTask``, ``BlobStream``, ``BufferList``) keeps the
serialized model of every transfer (task down, result up) in reference cycles. Python frees cycles only in a
generation-2 collection, which a process with millions of long-lived objects (torch, FLARE) runs rarely, so
the server's peak RSS grew by about one model per round for ten rounds or more before a collection caught up
(ResNet-18, 2 sites, 15 rounds: 1003 -> 1672 MiB). Collecting once per round frees them at once; handing glibc's
free heap pages back (``malloc_trim``) keeps the next round from growing the heap around the holes
(same run: 1004 -> 1276 MiB, flat from round 5; docs/benchmarks.md).

A full collection scans every tracked object: 0.16-0.23 s per round in that server. Moving the objects alive
after start-up to the permanent generation (``gc.freeze``) leaves only what the rounds create to scan (6-26 ms).
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Mapping

# glibc gives each thread that allocates its own arena (up to 8 per core), and every arena keeps its own free holes,
# which FLARE's many messaging threads leave with each round's transfers. One arena for the whole process cut the
# server's peak RSS over 30 rounds from 1514 to 1276 MiB and its growth after round 3 from +21 % to +8 %, at no
# measured cost in transfer or training time (docs/benchmarks.md). glibc reads it only when a process starts, so
# the launchers put it in the environment of FLARE's processes; a value already set there is kept.
ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "1"}


def with_allocator_settings(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus :data:`ALLOCATOR_ENV`, for a FLARE process medflare starts (the caller's own values win)."""
    return {**ALLOCATOR_ENV, **env}


def freeze_startup_objects() -> None:
    """Exempt everything alive now (modules, the model, FLARE's engine) from later collections.

    Call once, after start-up: objects frozen here are never collected, so a cycle among them that dies later
    stays allocated. Start-up objects live for the whole job, which is what makes that safe."""
    gc.collect()
    gc.freeze()


def collect_round_garbage() -> int:
    """Run a full collection, then return free heap pages to the OS; returns the unreachable objects found."""
    freed = gc.collect()
    _trim_heap()
    return freed


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``; a no-op where there is no glibc (macOS, musl, Windows)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's ``malloc_trim``, looked up once per process (None without glibc)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
