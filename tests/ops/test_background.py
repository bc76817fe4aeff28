"""One background write at a time: in order, and its error reaches the caller."""

import threading
import time

import pytest

from medflare.ops.background import BackgroundWrite


def test_writes_run_one_at_a_time_in_order() -> None:
    writer, done = BackgroundWrite("test"), []

    def slow(tag: str) -> None:
        time.sleep(0.05)
        done.append(tag)

    writer.start(lambda: slow("first"))
    writer.start(lambda: done.append("second"))  # waits for the first
    assert done[0] == "first"
    writer.wait()
    assert done == ["first", "second"]


def test_start_returns_before_the_write_finishes() -> None:
    writer, release = BackgroundWrite("test"), threading.Event()
    writer.start(release.wait)
    assert writer._thread is not None and writer._thread.is_alive()
    release.set()
    writer.wait()


def test_a_failed_write_raises_at_the_next_wait() -> None:
    writer = BackgroundWrite("test")
    writer.start(lambda: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()  # reported once
