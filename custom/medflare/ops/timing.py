"""Wall-clock spans: where a round's time goes, recorded by the controller and by each site."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


@contextlib.contextmanager
def timed(spans: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall seconds the block takes to ``spans[name]`` (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        spans[name] = spans.get(name, 0.0) + time.perf_counter() - start
