"""Warm memory for large buffers received through a socket.

Theory of operation
-------------------
A large tensor received through a socket (tcp, or unix without shared memory)
lands in storage the decoder allocates before the kernel copies the bytes in.
Fresh storage (``torch.empty``: glibc maps anything that large anew and unmaps it
when it is freed) must have every page faulted in, zeroed by the kernel, inside
``recv``: on the project's VM that halved an echo's bandwidth over loopback TCP (a
raw socket echo, 400 MB: 1.3 GB/s into fresh buffers, 2.8 GB/s into reused ones;
docs/architecture.md, "TCP between hosts").

A :class:`StoragePool` hands out, for a buffer of ``min_bytes`` or more, a view of a
private anonymous mapping, and takes the mapping back when the last tensor on that
view dies (a lease, as the shared-memory receiver's views have): the next large
receipt of about that size reuses it, its pages already faulted in.  What it gives
is the same kind of storage the shared-memory path already gives a receiver (a
tensor on a mapping that is not torch's, so not resizable).  Idle mappings are
bounded as the segment pool's are: beyond ``max_idle_bytes`` they are dropped,
oldest first, once idle for ``idle_grace``, except the one returned last (a
repeated transfer keeps its warm mapping); unmapping happens on the housekeeping
thread.  A mapping is reused for a buffer it holds with at most 25% to spare.
Smaller buffers come from ``small`` (fresh tensor storage: malloc keeps those warm).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

from asyncrpc.transport.housekeeping import housekeeper
from asyncrpc.transport.shm import DEFAULT_MAX_IDLE, IDLE_GRACE, _Lease, _Mapping

POOLED_MIN: Final = 1 << 20
"""Bytes.  Smaller received buffers are fresh storage (malloc reuses their pages)."""
Allocation = tuple[Any, memoryview]


class StoragePool:
    """See the module docstring.  ``allocate`` is a decoder's ``Allocator``."""

    def __init__(
        self,
        small: Callable[[int], Allocation],
        *,
        min_bytes: int = POOLED_MIN,
        max_idle_bytes: int = DEFAULT_MAX_IDLE,
        idle_grace: float = IDLE_GRACE,
    ) -> None:
        self._small = small
        self.min_bytes = min_bytes
        self.max_idle_bytes = max_idle_bytes
        self.idle_grace = idle_grace
        self._idle: list[tuple[_Mapping, float]] = []  # oldest first, with when it came back
        self._idle_bytes = 0
        self._lock = threading.RLock()  # a lease may end on any thread, even inside ours
        self._trim_due = False
        self.reused = 0  # allocations served from an idle mapping
        self.created = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    @property
    def stats(self) -> dict[str, int]:
        """Idle mappings kept warm (bytes, count, and the bound) and how receipts were
        served: from an idle mapping, or a new one."""
        with self._lock:
            return {
                "idle_bytes": self._idle_bytes,
                "idle_mappings": len(self._idle),
                "max_idle_bytes": self.max_idle_bytes,
                "reused": self.reused,
                "created": self.created,
            }

    def allocate(self, nbytes: int) -> Allocation:
        """Storage for ``nbytes`` received bytes: (owner, writable byte view)."""
        if nbytes < self.min_bytes:
            return self._small(nbytes)
        mapping = self._take_idle(nbytes)
        if mapping is None:
            mapping = _Mapping(-1, nbytes, populate=False, private=True)
            self.created += 1
        else:
            self.reused += 1
        lease = _Lease(functools.partial(self._give_back, weakref.ref(self), mapping))
        view = mapping.view(nbytes, lease)
        return view, view

    def clear(self) -> None:
        """Drop every idle mapping (those in use are unmapped when their tensors die)."""
        with self._lock:
            dropped = [mapping for mapping, _ in self._idle]
            self._idle, self._idle_bytes = [], 0
        housekeeper.drop(dropped)

    def trim(self) -> None:
        """Drop idle mappings beyond ``max_idle_bytes`` whose grace period is over."""
        with self._lock:
            self._trim_due = False
            dropped, due = self._trim(time.monotonic())
        housekeeper.drop(dropped)
        self._schedule_trim(due)

    def _take_idle(self, nbytes: int) -> _Mapping | None:
        """The smallest idle mapping that holds ``nbytes`` with at most 25% to spare."""
        with self._lock:
            idle = self._idle
            fits = [i for i, (m, _) in enumerate(idle) if nbytes <= m.nbytes <= nbytes * 5 // 4]
            if not fits:
                return None
            best = min(reversed(fits), key=lambda i: self._idle[i][0].nbytes)  # ties: warmest
            mapping = self._idle.pop(best)[0]
            self._idle_bytes -= mapping.nbytes
            return mapping

    @staticmethod
    def _give_back(pool_ref: weakref.ref[StoragePool], mapping: _Mapping) -> None:
        """The last tensor on ``mapping`` died: keep it for reuse (unless the pool is gone)."""
        pool = pool_ref()
        if pool is None or sys.is_finalizing():  # no thread starts now: unmap it here
            return
        with pool._lock:
            pool._idle.append((mapping, time.monotonic()))
            pool._idle_bytes += mapping.nbytes
            dropped, due = pool._trim(time.monotonic())
        housekeeper.drop(dropped)
        pool._schedule_trim(due)

    def _trim(self, now: float) -> tuple[list[_Mapping], float | None]:
        """Under the lock: idle mappings beyond ``max_idle_bytes`` idle for
        ``idle_grace``, oldest first, never the newest; and when to look again."""
        dropped: list[_Mapping] = []
        while self._idle_bytes > self.max_idle_bytes and len(self._idle) > 1:
            mapping, since = self._idle[0]
            if since > now - self.idle_grace:
                if self._trim_due:
                    return dropped, None
                self._trim_due = True
                return dropped, since + self.idle_grace
            self._idle.pop(0)
            self._idle_bytes -= mapping.nbytes
            dropped.append(mapping)
        return dropped, None

    def _schedule_trim(self, when: float | None) -> None:
        if when is not None:
            pool = weakref.ref(self)  # a chore does not keep a dropped pool alive
            housekeeper.call_at(when, lambda: _trim_if_alive(pool))


def _trim_if_alive(pool: weakref.ref[StoragePool]) -> None:
    alive = pool()
    if alive is not None:
        alive.trim()
