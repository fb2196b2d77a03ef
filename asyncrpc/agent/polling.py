"""Adaptive busy-polling: trade a bounded amount of CPU for wake-up latency.

Theory of operation
-------------------
A process that sleeps in ``epoll_wait`` pays a wake-up when the reply lands;
on virtual machines waking an idle vCPU costs tens of microseconds, more than
the rest of a small call.  After activity (a request or reply sent, a frame
received), the poller keeps the event loop turning (one ``call_soon`` per
iteration, so each turn polls the sockets with a zero timeout) for a while,
and only while ``wanted()`` says it is worth it.

How long adapts to the traffic, as a guest's halt-polling does: it starts at
the configured ``window``.  When polling ran out and the next activity came
soon after, within ``MAX_FACTOR`` windows of the last one, a slightly longer
poll would have caught it, so the window grows to cover that gap (a training
step's messages are a few hundred microseconds apart, one side computing in
between).  When the next activity came later than that, polling was wasted,
and the window halves, down to the configured one.  It never exceeds
``MAX_FACTOR`` times the configured window.

Each turn also yields the CPU (``sched_yield``, without the GIL): a spinning
loop must not keep a thread that has real work off its CPU.  On a host with
as many busy threads as CPUs (two workers, one of them running a pool job)
that thread would otherwise wait for the scheduler's next tick, and then for
the GIL (docs/architecture.md has what yielding saved).  The loop thread
releases the GIL in every poll, but a thread that spins still competes for it,
so the agent does not want spinning while slow pool jobs run.  A window of 0 turns polling off.

A frame handed up usually schedules work: the waiter of a reply, the task of a call.
The next turn is already queued ahead of it, so its yield would run first, on the
message's path; ``kick(behind=True)`` puts that turn behind the work (once a turn).

Workers are not the only threads that spin.  After each parallel op, torch's OpenMP
threads spin for milliseconds before they sleep (8-10 ms of CPU after a 4 MB
``copy_`` here), so workers that each run ops on several threads, more threads in all
than the host has CPUs, take CPUs from one another and from their loops.
:func:`oversubscribed` says so, and what to set, as torchrun does when it starts
several workers on one host.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

MAX_FACTOR = 8
"""The adapted window stays within this many configured windows."""
GROWTH = 1.25
"""A grown window covers the gap it missed with this much to spare."""


class BusyPoller:
    """Keeps one event loop polling briefly after activity; see the module docstring."""

    def __init__(
        self,
        window: float,
        wanted: Callable[[], bool],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._wanted = wanted
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        self._until = 0.0
        self._active = False
        self._next: asyncio.Handle | None = None  # the next turn, while active
        self._moved = False  # the next turn was put behind work scheduled this turn
        self._ran_out_at: float | None = None  # polling found nothing until then
        self.window = window

    @property
    def window(self) -> float:
        """The configured window (seconds); the adapted one starts there."""
        return self._window

    @window.setter
    def window(self, seconds: float) -> None:
        self._window = self.current = seconds

    def kick(self, *, behind: bool = False) -> None:
        """Activity happened: poll for up to the current window from now.  ``behind``:
        it scheduled work (a reply's waiter, a call's task), which the next turn, with
        its ``sched_yield``, must not come before (once per turn, however many frames)."""
        if self._window <= 0:
            return
        now = self._clock()
        if self._ran_out_at is not None:
            self._adapt(gap=now - (self._ran_out_at - self.current))
            self._ran_out_at = None
        self._until = now + self.current
        if not self._active:
            self._active = True
            self._moved = True
            self._next = self._loop.call_soon(self._turn)
        elif behind and not self._moved and self._next is not None:
            self._moved = True
            self._next.cancel()
            self._next = self._loop.call_soon(self._turn)

    def _adapt(self, gap: float) -> None:
        """The last poll ran out; activity came ``gap`` seconds after the one before."""
        longest = self._window * MAX_FACTOR
        if gap <= longest:
            self.current = min(longest, max(self.current, gap * GROWTH))
        else:
            self.current = max(self._window, self.current / 2)

    def _turn(self) -> None:
        os.sched_yield()  # see the module docstring
        now = self._clock()
        if now < self._until and self._wanted():
            self._moved = False
            self._next = self._loop.call_soon(self._turn)
            return
        self._active = False
        if now >= self._until:
            self._ran_out_at = self._until


def oversubscribed(workers: int, threads: int, cpus: int) -> str | None:
    """Why ``workers`` on one host, each running torch ops on ``threads`` intra-op
    threads, crowd its ``cpus`` CPUs, and what to set instead; None if they do not (or
    fewer threads each would not help)."""
    if threads <= 1 or workers * threads <= cpus:
        return None
    each = max(1, cpus // workers)
    return (
        f"{workers} workers share this host's {cpus} CPUs and each runs torch ops on "
        f"{threads} threads: after every parallel op OpenMP's threads spin for "
        f"milliseconds, taking CPUs from the other workers and their event loops; set "
        f"torch.set_num_threads({each}) (or OMP_NUM_THREADS={each}) in each worker, as "
        f"torchrun does for several workers on one host (docs/deploy.md)"
    )
