"""One file write at a time, off the critical path: a round's checkpoint or a site's state is written while the
next thing (sending the result, the sites' training) goes on."""

from __future__ import annotations

import threading
from typing import Callable


class BackgroundWrite:
    """Runs one write in a thread; :meth:`wait` blocks until it is done and re-raises what it raised.

    A new write waits for the previous one first, so at most one is in flight and writes land in order. The
    caller must hand over data the write alone owns (a snapshot) or :meth:`wait` before changing it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        """Wait for the write in flight, then run ``write`` in a new thread."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # handed to the caller by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) finished; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
