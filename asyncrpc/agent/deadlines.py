"""The deadlines of a worker's calls, kept on one loop timer.

Theory of operation
-------------------
Every call with a timeout has a deadline, and almost every call ends long
before it.  A timer per call (``call_later`` when it starts, ``cancel`` when it
ends) costs about 2 µs of the loop a call here: a handle, and the event loop's
timer heap entered and left twice.  :class:`Deadlines` keeps ``(deadline, key)``
in a heap of its own instead (``heappush``, ~0.2 µs) and one loop timer, armed
at the earliest deadline it holds.  A call that ends is not looked for in the
heap: its entry stays, and is skipped when it comes up, because the key is no
longer among the ``live`` ones (the agent's pending calls).

When the timer fires, every entry now due is popped: ``expire(key)`` runs for
each one still live, in deadline order, and the timer is armed again at the
next deadline.  So that the entries of ended calls cannot pile up (at 50,000
calls a second and a 60 s timeout, three million of them), the heap is rebuilt
from the live entries alone once it has doubled since the last rebuild (and holds
more than ``COMPACT_ABOVE``): linear work, paid once per as many calls.

A timer may fire up to ``DUE_WITHIN`` early (the event loop's clock and its
timers are not exact); a deadline that close counts as reached, as the
per-call timer that fired then did.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Callable, Container

COMPACT_ABOVE = 1024
"""The heap is rebuilt from its live entries only once it holds more than this."""
DUE_WITHIN = 1e-3
"""Seconds: a deadline this close to the loop's time when the timer fires is reached."""

log = logging.getLogger("asyncrpc.agent")


class Deadlines:
    """Deadlines by key on one loop timer; see the module docstring."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        expire: Callable[[int], None],
        live: Container[int],
    ) -> None:
        self._loop = loop
        self._expire = expire
        self._live = live
        self._heap: list[tuple[float, int]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = math.inf
        self._compact_above = COMPACT_ABOVE

    def add(self, key: int, timeout: float) -> None:
        """``key`` expires in ``timeout`` seconds unless it is no longer live then."""
        deadline = self._loop.time() + timeout
        heap = self._heap
        heapq.heappush(heap, (deadline, key))
        if deadline < self._armed_for:
            self._arm(deadline)
        if len(heap) > self._compact_above:
            heap[:] = [entry for entry in heap if entry[1] in self._live]
            heapq.heapify(heap)
            self._compact_above = max(COMPACT_ABOVE, 2 * len(heap))

    def __len__(self) -> int:
        """Entries held, those of ended keys included (for tests and debugging)."""
        return len(self._heap)

    def close(self) -> None:
        """Forget every deadline; nothing expires any more."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._armed_for = math.inf
        self._heap.clear()

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(deadline, self._fire)
        self._armed_for = deadline

    def _fire(self) -> None:
        self._timer = None
        self._armed_for = math.inf
        heap = self._heap
        due = self._loop.time() + DUE_WITHIN
        while heap and heap[0][0] <= due:
            key = heapq.heappop(heap)[1]
            if key in self._live:
                try:
                    self._expire(key)
                except Exception:  # one expiry's failure must not strand the others
                    log.exception("expiring call %d failed", key)
        while heap and heap[0][1] not in self._live:  # the next live deadline arms it
            heapq.heappop(heap)
        if heap:
            self._arm(heap[0][0])
