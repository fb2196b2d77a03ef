"""One background thread per process for the shared-memory chores no event loop should do.

Theory of operation
-------------------
Giving shared memory back is slow: the last unmap of a segment frees its pages,
which took 10-30 ms for 64 MiB and 90-750 ms for 400 MiB on our 2-core VM.  So
the objects that hold mappings are handed to :data:`housekeeper`, whose thread
drops them (``drop`` empties the list it is given, so the caller's references
are gone and the thread's are the last; a reference held elsewhere, such as a
tensor on a view, just makes the unmap happen later, where that one dies).

The same thread runs timed chores (``call_at``): a segment pool trims idle
segments it has kept past their grace period, whether or not anything else
happens by then.  A chore that raises is logged; the thread carries on.  It is a
daemon thread: at exit the kernel takes the mappings back anyway.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("asyncrpc.transport")
Chore = tuple[float, int, Callable[[], None]]


class Housekeeper:
    """See the module docstring."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Any] | Chore] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._order = itertools.count()

    def drop(self, objects: list[Any]) -> None:
        """Let go of ``objects`` on the housekeeping thread; empties the list."""
        if objects:
            self._put(objects[:])
            objects.clear()

    def call_at(self, when: float, chore: Callable[[], None]) -> None:
        """Run ``chore()`` on the housekeeping thread at ``time.monotonic()`` ``when``."""
        self._put((when, next(self._order), chore))

    def _put(self, item: list[Any] | Chore) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(
                    target=self._run, name="asyncrpc-housekeeping", daemon=True
                ).start()
        self._queue.put(item)

    def _run(self) -> None:
        chores: list[Chore] = []
        while True:
            self._wait(chores)
            while chores and chores[0][0] <= time.monotonic():
                _run_chore(heapq.heappop(chores)[2])

    def _wait(self, chores: list[Chore]) -> None:
        """Until the next chore is due or something arrives (dropped at once)."""
        timeout = max(0.0, chores[0][0] - time.monotonic()) if chores else None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return
        if isinstance(item, tuple):
            heapq.heappush(chores, item)
        # a list of objects to drop goes with this frame


def _run_chore(chore: Callable[[], None]) -> None:
    try:
        chore()
    except Exception:
        log.exception("shared-memory housekeeping chore failed")


housekeeper = Housekeeper()
