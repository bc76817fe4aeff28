"""Each round's reference cycles are freed when the round ends, on the server and at the sites."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from medflare.console.simulate import run_simulation
from medflare.flare.memory import ALLOCATOR_ENV, collect_round_garbage, freeze_startup_objects, with_allocator_settings
from medflare.plan import resolve
from medflare.run_config import RunConfig


class Holder:
    """Stands in for FLARE's stream objects: a cycle that keeps a large buffer alive."""

    def __init__(self) -> None:
        self.buffer = np.ones(1_000_000, dtype=np.float32)
        self.me = self


def cycle_holding_a_buffer() -> weakref.ref:
    return weakref.ref(Holder().buffer)


@pytest.fixture
def automatic_gc_off() -> Iterator[None]:
    """Without automatic collections only an explicit one frees a cycle, so the tests can fail."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_round_collection_frees_a_cycle_that_holds_a_buffer(automatic_gc_off: None) -> None:
    buffer = cycle_holding_a_buffer()
    assert buffer() is not None  # the control: dropping the last name frees nothing in a cycle
    assert collect_round_garbage() >= 1  # the Holder; its __dict__ counts only where Python materialised it
    assert buffer() is None


def test_frozen_start_up_objects_do_not_hide_a_later_rounds_garbage(automatic_gc_off: None) -> None:
    started = cycle_holding_a_buffer()
    try:
        freeze_startup_objects()  # collects first: a start-up cycle already dead is not kept forever
        assert started() is None
        later = cycle_holding_a_buffer()
        collect_round_garbage()
        assert later() is None
    finally:
        gc.unfreeze()


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_the_server_collects_after_every_round_in_the_simulator(tmp_path: Path) -> None:
    config = RunConfig(method="fedavg", rounds=2, clients=2, data={"source": "synthetic:n=240,classes=3"},
                       train={"max_steps": 2, "batch_size": 16})
    run_simulation(resolve(config, "byoc"), tmp_path / "run", echo=lambda line: None)
    results = json.loads((tmp_path / "run" / "medflare_results.json").read_text())
    assert results["allocator"] == ALLOCATOR_ENV  # the launcher started FLARE's processes with it
    rounds = results["rounds"]
    assert len(rounds) == 2
    for record in rounds:
        assert record["gc_objects_freed"] > 0  # every round's transfers leave cycles behind
        assert 0.0 <= record["server_seconds"]["gc"] < 1.0


THREADS_THAT_ALLOCATE = textwrap.dedent("""
    import ctypes, threading
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    barrier = threading.Barrier(4)
    def allocate():
        barrier.wait()  # all four alive at once, so none inherits an arena another thread has given up
        for _ in range(2000):
            libc.free(ctypes.c_void_p(libc.malloc(1024)))
    threads = [threading.Thread(target=allocate) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc.malloc_stats()  # one "Arena k:" block per arena, on stderr
""")


def arenas_used(env: dict[str, str]) -> int:
    proc = subprocess.run([sys.executable, "-c", THREADS_THAT_ALLOCATE], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.count("Arena ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_launchers_allocator_setting_keeps_threads_on_one_arena() -> None:
    plain = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    assert arenas_used(plain) > 1  # the control: by default glibc gives each new thread an arena of its own
    assert arenas_used(with_allocator_settings(plain)) == 1


def test_a_value_the_user_set_is_kept() -> None:
    assert with_allocator_settings({"PATH": "/bin"}) == {"PATH": "/bin", **ALLOCATOR_ENV}
    assert with_allocator_settings({"MALLOC_ARENA_MAX": "4"})["MALLOC_ARENA_MAX"] == "4"


def test_a_site_collects_its_upload_garbage_after_sending_not_when_the_next_task_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collection takes ~0.15 s in a site process holding a ResNet-18: at the start of a task it delayed every
    round; after the result is sent it overlaps the server's aggregation."""
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable
    from nvflare.apis.signal import Signal

    from medflare.flare import executor as site_executor

    calls: list[str] = []
    monkeypatch.setattr(site_executor, "collect_round_garbage", lambda: calls.append("collected") or 0)
    monkeypatch.setattr(site_executor.MedflareExecutor, "_get_runtime", lambda self, fl_ctx: object())
    monkeypatch.setattr(site_executor.MedflareExecutor, "_dispatch",
                        lambda self, *args: (_ for _ in ()).throw(RuntimeError("no training here")))
    site = site_executor.MedflareExecutor()
    site.execute("train", Shareable(), FLContext(), Signal())  # the task runs (and fails: answers an error)
    assert calls == []
    site.handle_event(EventType.AFTER_SEND_TASK_RESULT, FLContext())
    assert calls == ["collected"]
