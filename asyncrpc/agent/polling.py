"""Adaptive busy-polling: trade a bounded amount of CPU for wake-up latency.

Theory of operation
-------------------
A process that sleeps in ``epoll_wait`` pays a wake-up when the reply lands;
on virtual machines waking an idle vCPU costs tens of microseconds, more than
the rest of a small call.  After activity (a request or reply sent, a frame
received), the poller keeps the event loop turning (one ``call_soon`` per
iteration, so each turn polls the sockets with a zero timeout) for at most
``window`` seconds, and only while ``wanted()`` says it is worth it.

Each turn also yields the CPU (``sched_yield``, without the GIL): a spinning
loop must not keep a thread that has real work off its CPU.  On a host with
as many busy threads as CPUs (two workers, one of them running a pool job)
that thread would otherwise wait for the scheduler's next tick, and then for
the GIL; measured on a 2-vCPU VM, the plain no-op round trip went from about
130 to about 105 µs.  The loop thread releases the GIL in every poll, but a
thread that spins still competes for it, so the agent does not want spinning
while slow pool jobs run.  A window of 0 turns polling off.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable


class BusyPoller:
    """Keeps one event loop polling briefly after activity; see the module docstring."""

    def __init__(self, window: float, wanted: Callable[[], bool]) -> None:
        self.window = window
        self._wanted = wanted
        self._loop = asyncio.get_running_loop()
        self._until = 0.0
        self._active = False

    def kick(self) -> None:
        """Activity happened: poll for up to ``window`` seconds from now."""
        if self.window <= 0:
            return
        self._until = time.perf_counter() + self.window
        if not self._active:
            self._active = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        os.sched_yield()  # see the module docstring
        if time.perf_counter() < self._until and self._wanted():
            self._loop.call_soon(self._turn)
        else:
            self._active = False
