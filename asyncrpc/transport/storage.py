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
bounded as the segment pool's are, by the same
:class:`~asyncrpc.transport.housekeeping.IdleCache`: beyond ``max_idle_bytes`` they are dropped,
oldest first, once idle for ``idle_grace``, except the one returned last (a
repeated transfer keeps its warm mapping); unmapping happens on the housekeeping
thread.  A mapping is reused for a buffer it holds with at most 25% to spare.
Smaller buffers come from ``small`` (fresh tensor storage: malloc keeps those warm).

A new mapping is faulted in ahead of the socket by the pool's prefault thread
(``MADV_POPULATE_WRITE``, ``PREFAULT_PIECE`` at a time from the front, while the
bytes arrive behind it): a page faulted in bulk there costs less than one faulted
inside ``recv``, and the two run on two cores (a raw 400 MB receipt over loopback
TCP into a fresh mapping: 385 ms alone, 156 ms with the thread running ahead;
docs/architecture.md, "TCP between hosts").  It only maps pages: what the socket
has already written stays as it is.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

from asyncrpc.transport.housekeeping import Copiers, IdleCache, housekeeper, schedule_trim
from asyncrpc.transport.shm import DEFAULT_MAX_IDLE, IDLE_GRACE, _Lease, _Mapping

POOLED_MIN: Final = 1 << 20
"""Bytes.  Smaller received buffers are fresh storage (malloc reuses their pages)."""
PREFAULT_PIECE: Final = 4 << 20
"""Bytes faulted in by one system call of the prefault thread."""
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
        self._idle = IdleCache[_Mapping](max_idle_bytes, idle_grace, _nbytes)
        self._lock = threading.RLock()  # a lease may end on any thread, even inside ours
        self.reused = 0  # allocations served from an idle mapping
        self.created = 0
        self._prefaulter = Copiers(1, "asyncrpc-prefault")

    @property
    def idle_bytes(self) -> int:
        return self._idle.bytes

    @property
    def stats(self) -> dict[str, int]:
        """Idle mappings kept warm (bytes, count, and the bound) and how receipts were
        served: from an idle mapping, or a new one."""
        with self._lock:
            return {
                "idle_bytes": self._idle.bytes,
                "idle_mappings": len(self._idle),
                "max_idle_bytes": self._idle.max_idle_bytes,
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
            self._prefaulter.submit(functools.partial(_prefault, mapping))
            self.created += 1
        else:
            self.reused += 1
        lease = _Lease(functools.partial(self._give_back, weakref.ref(self), mapping))
        view = mapping.view(nbytes, lease)
        return view, view

    def clear(self) -> None:
        """Drop every idle mapping (those in use are unmapped when their tensors die)."""
        with self._lock:
            dropped = self._idle.clear()
        housekeeper.drop(dropped)

    def close(self) -> None:
        """Drop every idle mapping and end the prefault thread (after its jobs)."""
        self.clear()
        self._prefaulter.shutdown()

    def trim(self) -> None:
        """Drop idle mappings beyond ``max_idle_bytes`` whose grace period is over."""
        with self._lock:
            self._idle.chore_ran()
            dropped, due = self._idle.expired(time.monotonic())
        housekeeper.drop(dropped)
        schedule_trim(self, due)

    def _take_idle(self, nbytes: int) -> _Mapping | None:
        """An idle mapping for ``nbytes`` (see IdleCache.take), or None."""
        with self._lock:
            return self._idle.take(nbytes)

    @staticmethod
    def _give_back(pool_ref: weakref.ref[StoragePool], mapping: _Mapping) -> None:
        """The last tensor on ``mapping`` died: keep it for reuse (unless the pool is gone)."""
        pool = pool_ref()
        if pool is None or sys.is_finalizing():  # no thread starts now: unmap it here
            return
        now = time.monotonic()
        with pool._lock:
            pool._idle.add(mapping, now)
            dropped, due = pool._idle.expired(now)
        housekeeper.drop(dropped)
        schedule_trim(pool, due)


def _prefault(mapping: _Mapping) -> None:
    """Fault ``mapping`` in from the front, a piece at a time, until done or refused."""
    for offset in range(0, mapping.nbytes, PREFAULT_PIECE):
        if not mapping.populate(offset, min(PREFAULT_PIECE, mapping.nbytes - offset)):
            return


def _nbytes(mapping: _Mapping) -> int:
    return mapping.nbytes
