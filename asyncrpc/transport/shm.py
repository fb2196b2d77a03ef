"""Same-host fast path: large buffers travel through pooled shared-memory segments.

Theory of operation
-------------------
Through a socket a buffer is copied twice (into the kernel, out of it) and the
receiver faults in fresh pages.  Between processes of one kernel, PID namespace and
user (``locality.MEMORY``: the link checks their hosts) we do better:

* The sender copies the bytes once into a *segment* (a ``memfd`` it maps) and
  sends only ``ExternalRef(key, nbytes)`` in the frame.  A key is the segment's
  serial number (never reused by that process, and part of the memfd's name)
  and its descriptor number.
* The receiver opens ``/proc/<sender pid>/fd/<fd>`` the first time it sees a
  key (the kernel lets only the same user do so; the memfd's name must carry
  the key's serial), maps the whole segment once (its pages are mapped in by
  whoever reads them first, not on the event loop), and keeps that mapping in a
  :class:`SegmentMapper` cache.  Each transfer is a *view* of the cached mapping
  that becomes the tensor's storage: no second copy, and no system call at all
  for a segment seen before.
* When the last tensor on a view dies, its lease tells the sender (a RELEASE
  message) that the segment is free; the sender reuses it.  Reused segments
  are faulted in on both sides, so a warm transfer costs one memcpy.

Memory is bounded.  A :class:`SegmentPool` holds at most ``budget`` bytes of
segments, lent (copied into and not yet released) plus idle.  A buffer that
would take it past the budget gets no segment: ``lend`` returns None and the
caller sends the bytes through the socket, whose flow control already bounds
them (a fallback, counted in ``stats``).  Nothing ever waits for shared memory,
so a receiver that keeps its tensors alive forever slows its sender down to
socket speed and no further.  A new segment that does not fit closes idle ones
first.  Idle segments beyond ``max_idle_bytes`` are closed, oldest first, once
they have been idle for ``idle_grace`` (by the housekeeping thread if nothing
else happens), except the one released last (a repeated transfer of any size
keeps its warm segment); the grace keeps a working set that cycles through
more than the cap (two 400 MB segments in an echo) from being closed and
faulted in again at every turn.  Capacities are multiples of ``GRANULE`` (64
KiB), and an idle segment is reused for a buffer it holds with at most 25% to
spare (that rule, and the one for closing idle segments, are
:class:`~asyncrpc.transport.housekeeping.IdleCache`'s).

Lending and filling are separate steps: ``lend`` (cheap: a memfd and
``ftruncate``) fixes the key, so a frame can be encoded at once, and
``Segment.fill`` (the mmap of a new segment, its page faults and the memcpy,
all without the GIL) can run on another thread (``fill_later``: the pool's
copier threads); ``put`` does both.  A large copy is shared by the thread that
wants it and the free copiers (``COPY_PIECE``, or the smaller ``FRESH_PIECE`` into
pages never faulted in): faults and memcpy on every core.
Unmapping is slow too (the last unmap frees the pages), so mappings are let go
on the housekeeping thread (:mod:`.housekeeping`).

That a receiver can open and map our segments is proven, not assumed, before
any is lent to it: each pool holds a *probe*, a one-page segment with a random
serial (``probe_key``), that a peer opens and maps in the handshake
(``open_probe``) and says whether it could; a link lends segments only to a peer
that could (see :mod:`.link`).

A segment is reused only after its receiver released it, so the receiver never
sees its tensor change.  When a link is lost its in-use segments are closed on
the sender's side and never reused: a still-living receiver keeps its mapping.
Whenever the pool closes a segment, every owner it was lent to hears of it
(``SegmentOwner.segments_closed``), so that its peer can drop the mapping from
its cache (an UNMAP message): a receiver's cache never pins memory the sender
has given up.  The cache is also bounded (least recently used first out; the
agent sets the bound to its own budget).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import logging
import mmap
import os
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.transport.housekeeping import Copiers, IdleCache, housekeeper, schedule_trim
from asyncrpc.wire import ExternalRef

log = logging.getLogger("asyncrpc.transport")

SHM_THRESHOLD: Final = 1 << 20
"""Buffers of at least this many bytes take the shared-memory path (see benchmarks/)."""
DEFAULT_BUDGET: Final = 1 << 30
"""Bytes of segments one worker may hold, lent plus idle (see docs/architecture.md)."""
DEFAULT_MAX_IDLE: Final = 256 << 20
"""Bytes of idle segments kept for reuse (the one released last is always kept)."""
IDLE_GRACE: Final = 1.0
"""Seconds an idle segment beyond ``max_idle_bytes`` is kept before it is closed."""
GRANULE: Final = 64 << 10
"""Segment capacities are multiples of this."""
COPIER_THREADS: Final = 2
COPY_PIECE: Final = 4 << 20
"""A copy of more bytes than this is cut in pieces of this size, shared by threads."""
FRESH_PIECE: Final = 1 << 20
"""The same for a copy into pages never faulted in, whose faults cost more than the
copy: 4 MiB into a fresh segment, one thread 3.4 ms, two 1.8-2.0 ms here."""
_MEMFD_NAME: Final = "asyncrpc-segment"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MADV_POPULATE_WRITE: Final = 23  # Linux 5.14 and later
_MAP_FAILED = ctypes.c_void_p(-1).value
_PAGE: Final = mmap.PAGESIZE


def populate(address: int, nbytes: int) -> bool:
    """Fault in (writable) the pages that hold ``nbytes`` from ``address``, leaving what
    they hold as it is, in one system call and without the GIL: False where the kernel
    cannot (older than 5.14, or out of memory: whoever writes them faults them itself)."""
    start = address - address % _PAGE
    done: int = _libc.madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE)
    return done == 0


def fault_in(view: memoryview) -> None:
    """``populate`` the memory of a writable byte view unless its last page is in memory
    already (one ``mincore``: populating 400 MB of present pages still took ~38 ms here,
    walking them, against ~145 ms for fresh ones)."""
    if not view.nbytes:
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    last = address + view.nbytes - 1
    resident = ctypes.c_ubyte(0)
    if _libc.mincore(last - last % _PAGE, 1, ctypes.byref(resident)) != 0 or not resident.value & 1:
        populate(address, view.nbytes)


_FD_BITS = 32


class _Mapping:
    """One ``mmap`` made through libc, so that it holds no file descriptor (Python's
    ``mmap.mmap`` keeps a duplicate open for the mapping's whole life).  Unmapped
    when the last reference goes."""

    def __init__(self, fd: int, nbytes: int, *, populate: bool, private: bool = False) -> None:
        """Map ``nbytes`` of ``fd`` shared; ``private``: anonymous memory (``fd`` -1)."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS if private else mmap.MAP_SHARED
        flags |= mmap.MAP_POPULATE if populate else 0
        address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if address in (None, _MAP_FAILED):
            code = ctypes.get_errno()
            raise OSError(code, f"mmap of {nbytes} bytes failed: {os.strerror(code)}")
        self.address: int = address
        self.nbytes = nbytes

    def view(self, nbytes: int, lease: object = None) -> memoryview:
        """A byte view of the first ``nbytes``; it keeps this mapping (and ``lease``) alive.

        Ownership runs one way only (view -> ctypes array -> mapping, lease), so both
        are dropped the moment the last view, or tensor built on one, dies.
        """
        array = (ctypes.c_char * nbytes).from_address(self.address)
        array._owners = (self, lease)  # type: ignore[attr-defined]
        return memoryview(array).cast("B")

    def populate(self, offset: int, nbytes: int) -> bool:
        """Fault in (writable) the pages of ``nbytes`` from ``offset``, leaving what they
        hold as it is, in one system call and without the GIL: False where the kernel
        cannot (older than 5.14, or out of memory: the copy will fault them itself)."""
        return populate(self.address + offset, nbytes)

    def __del__(self, _munmap: Any = _libc.munmap) -> None:
        # (Bound at definition: a mapping a module global kept dies at exit, after the
        # interpreter may have cleared this module's globals.)
        _munmap(self.address, self.nbytes)


class _Lease:
    """Held by the views of one transfer; when they are all gone, the segment is free."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._on_release = on_release

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # A tensor a module global kept dies as the interpreter exits, when modules may be
        # half torn down: nobody is left to tell then (the peer frees what it lent when
        # the connection closes).
        if not _finalizing():
            self._on_release()


class SegmentOwner(Protocol):
    """What segments are lent to (a link): told when segments it was lent are closed."""

    def segments_closed(self, keys: list[int]) -> None:
        """The pool closed these segments for good (called from any thread)."""


@dataclass(slots=True, eq=False)
class Segment:
    """One memfd and the sender's mapping of it, made by the first ``fill``: an mmap
    waits for the process's other mmaps and munmaps (a large unmap takes long), so it
    is no work for an event loop."""

    key: int
    fd: int
    capacity: int
    mapping: _Mapping | None = None
    lent_to: set[SegmentOwner] = field(default_factory=set)  # whose peers may map it
    filled: int = 0  # the most bytes copied in so far: those pages are faulted in
    _lock: threading.Lock = field(default_factory=threading.Lock)  # fd against mapping

    def ref(self, nbytes: int) -> ExternalRef:
        return ExternalRef(self.key, nbytes)

    def fill(self, data: memoryview, helpers: Copiers | None = None) -> None:
        """Copy ``data`` in (any thread; the GIL is released for the copy and for the page
        faults of a new segment, which cost as much as the copy or more); ``helpers``
        share a large copy."""
        with self._lock:  # a closed descriptor's number may name another file by now
            if self.fd < 0:
                raise OSError(errno.EBADF, "shared-memory segment closed")
            if self.mapping is None:
                self.mapping = _Mapping(self.fd, self.capacity, populate=False)
            mapping = self.mapping
        _copy_into(mapping, data, helpers, fresh_from=self.filled)
        self.filled = max(self.filled, len(data))

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)  # the mapping goes with the last reference to it


class SegmentPool:
    """The sender's side: segments to copy outgoing buffers into, within a budget.
    Thread-safe."""

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        max_idle_bytes: int = DEFAULT_MAX_IDLE,
        idle_grace: float = IDLE_GRACE,
    ) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._idle = IdleCache[Segment](max_idle_bytes, idle_grace, _capacity)
        self._in_use: dict[int, tuple[Segment, SegmentOwner]] = {}
        self._bytes_in_use = 0
        self._peak = 0
        self._fallbacks = 0
        self._fallback_bytes = 0
        self._bytes_lent = 0  # bytes of the buffers lent segments were asked for, ever
        self._serials = itertools.count(1)
        self._copiers = Copiers(COPIER_THREADS, "asyncrpc-shm-copy")
        self._copying = 0
        self._probe = _create_probe()

    @property
    def max_idle_bytes(self) -> int:
        return self._idle.max_idle_bytes

    @property
    def probe_key(self) -> int | None:
        """The key of our probe segment, for a peer to open (None: we could make none,
        so we lend nothing)."""
        return None if self._probe is None else self._probe.key

    def fill_later(self, fills: list[tuple[Segment, memoryview]]) -> Future[None]:
        """Fill segments on a copier thread; while any copy is in flight, ``copying``
        says so (an event loop need not spin meanwhile)."""
        with self._lock:
            self._copying += 1
        job = self._copiers.submit(functools.partial(fill_all, fills, self._copiers))
        job.add_done_callback(lambda _: self._copy_done())
        return job

    @property
    def copying(self) -> int:
        """Copies in flight on the copier threads."""
        return self._copying

    def _copy_done(self) -> None:
        with self._lock:
            self._copying -= 1

    def lend(self, nbytes: int, owner: SegmentOwner) -> Segment | None:
        """A segment of at least ``nbytes`` lent to ``owner``, not yet filled: an idle
        one, else a new one if the budget allows; None (a fallback) if not."""
        closed: list[Segment] = []
        with self._lock:
            segment = self._take_idle(nbytes)
            capacity = 0 if segment is not None else self._reserve(nbytes, closed)
        self._close(closed)
        if capacity:
            segment = self._create(capacity)
        with self._lock:
            if segment is None:
                self._fallbacks += 1
                self._fallback_bytes += nbytes
                return None
            self._in_use[segment.key] = (segment, owner)
            self._bytes_lent += nbytes
            segment.lent_to.add(owner)
            self._peak = max(self._peak, self._bytes_in_use + self._idle.bytes)
        return segment

    def put(self, data: memoryview, owner: SegmentOwner) -> ExternalRef | None:
        """Copy ``data`` into a segment lent to ``owner`` and return its reference;
        None if it should go through the socket instead (no room in the budget, no
        segment to be had, or the copy failed)."""
        segment = self.lend(len(data), owner)
        if segment is None:
            return None
        try:
            segment.fill(data, self._copiers)
        except Exception as exc:  # a bug, but the bytes can still go through the socket
            log.warning("copy into shared memory failed (%r); using the socket", exc)
            self.discard([segment], fallback=True)
            return None
        return segment.ref(len(data))

    def release(self, keys: Iterable[int], owner: SegmentOwner) -> None:
        """The receiver on ``owner`` is done with these segments: they may be reused."""
        now = time.monotonic()
        with self._lock:
            for key in keys:
                entry = self._in_use.get(key)
                if entry is not None and entry[1] is owner:
                    del self._in_use[key]
                    self._bytes_in_use -= entry[0].capacity
                    self._idle.add(entry[0], now)
            closed, due = self._idle.expired(now)
        self._close(closed)
        schedule_trim(self, due)

    def trim(self) -> None:
        """Close idle segments beyond ``max_idle_bytes`` whose grace period is over
        (the housekeeping thread calls this when one ends)."""
        with self._lock:
            self._idle.chore_ran()
            closed, due = self._idle.expired(time.monotonic())
        self._close(closed)
        schedule_trim(self, due)

    def discard(self, segments: list[Segment], *, fallback: bool = False) -> None:
        """Close lent segments that will never reach their receiver (a failed copy;
        ``fallback``: their bytes go through the socket instead, count them)."""
        with self._lock:
            mine = [s for s in segments if self._in_use.pop(s.key, None) is not None]
            self._bytes_in_use -= sum(s.capacity for s in mine)
            if fallback:
                self._fallbacks += len(segments)
                self._fallback_bytes += sum(s.capacity for s in segments)
        self._close(mine)  # the rest were closed by ``forget`` already

    def forget(self, owner: SegmentOwner) -> None:
        """``owner`` is gone: close (never reuse) the segments lent to it."""
        with self._lock:
            lost = [key for key, (_, o) in self._in_use.items() if o is owner]
            segments = [self._in_use.pop(key)[0] for key in lost]
            self._bytes_in_use -= sum(s.capacity for s in segments)
            kept = (s for s, _ in self._in_use.values())
            _forget_owner(owner, [*self._idle.buffers, *kept, *segments])
        self._close(segments)

    def close(self) -> None:
        with self._lock:
            segments = self._idle.clear() + [s for s, _ in self._in_use.values()]
            self._in_use, self._bytes_in_use = {}, 0
        _close_all(segments)  # peers are told nothing: their links go down now
        if self._probe is not None:
            self._probe.close()
        housekeeper.drop(segments)
        self._copiers.shutdown()

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "budget": self.budget,
                "max_idle_bytes": self.max_idle_bytes,
                "bytes_in_use": self._bytes_in_use,
                "bytes_idle": self._idle.bytes,
                "peak_bytes": self._peak,
                "segments_in_use": len(self._in_use),
                "segments_idle": len(self._idle),
                "fallbacks": self._fallbacks,
                "fallback_bytes": self._fallback_bytes,
                "bytes_lent": self._bytes_lent,
            }

    # -- under the lock ------------------------------------------------------------

    def _take_idle(self, nbytes: int) -> Segment | None:
        """An idle segment for ``nbytes`` (see IdleCache.take), now in use."""
        best = self._idle.take(nbytes)
        if best is not None:
            self._bytes_in_use += best.capacity
        return best

    def _reserve(self, nbytes: int, closed: list[Segment]) -> int:
        """Budget for a new segment: its capacity, after closing idle segments to make
        room (into ``closed``); 0 if lent segments alone leave no room."""
        capacity = -(-nbytes // GRANULE) * GRANULE
        if self._bytes_in_use + capacity > self.budget:
            return 0
        while self._bytes_in_use + self._idle.bytes + capacity > self.budget:
            closed.append(self._idle.pop_oldest())
        self._bytes_in_use += capacity
        return capacity

    # -- outside the lock ----------------------------------------------------------

    def _create(self, capacity: int) -> Segment | None:
        serial = next(self._serials)
        try:
            return _create_segment(capacity, serial)
        except OSError as exc:  # out of descriptors or memory: use the socket
            log.warning("cannot create a shared-memory segment (%s); using the socket", exc)
            with self._lock:
                self._bytes_in_use -= capacity
            return None

    @staticmethod
    def _close(segments: list[Segment]) -> None:
        """Close segments, tell each owner they were lent to, and unmap them off this
        thread (``segments`` is emptied: its references were the last)."""
        for owner, keys in _close_all(segments).items():
            owner.segments_closed(keys)
        housekeeper.drop(segments)


def _capacity(segment: Segment) -> int:
    return segment.capacity


def _close_all(segments: list[Segment]) -> dict[SegmentOwner, list[int]]:
    """Close each segment's descriptor; returns the keys each owner was lent."""
    told: dict[SegmentOwner, list[int]] = {}
    for segment in segments:
        segment.close()
        for owner in segment.lent_to:
            told.setdefault(owner, []).append(segment.key)
    return told


def _forget_owner(owner: SegmentOwner, segments: list[Segment]) -> None:
    for segment in segments:
        segment.lent_to.discard(owner)


def fill_all(fills: list[tuple[Segment, memoryview]], helpers: Copiers | None = None) -> None:
    """Fill each segment with its buffer (a copier thread's job), ``helpers`` sharing
    large copies."""
    for segment, data in fills:
        segment.fill(data, helpers)


def _copy_into(
    destination: _Mapping, source: memoryview, helpers: Copiers | None, fresh_from: int
) -> None:
    """memcpy through ctypes, which lets go of the GIL for the copy (slice assignment
    would hold it, stalling the event loop while a pool thread copies megabytes); a
    copy of several ``COPY_PIECE``s (``FRESH_PIECE``s, when it goes into pages never
    faulted in) is shared with ``helpers``, and each piece from
    ``fresh_from`` on (pages never faulted in) is faulted in in bulk first: 400 MiB
    into a fresh segment on two threads, 156-164 -> 132-138 ms here."""
    nbytes = len(source)
    if source.readonly:
        destination.view(nbytes)[:] = source
        return
    source_address = ctypes.addressof(ctypes.c_char.from_buffer(source))
    piece = COPY_PIECE if nbytes <= fresh_from else FRESH_PIECE
    if helpers is None or nbytes <= piece:
        ctypes.memmove(destination.address, source_address, nbytes)
        return
    helpers.share(
        [
            functools.partial(
                _copy_piece,
                destination,
                offset,
                source_address + offset,
                min(piece, nbytes - offset),
                offset >= fresh_from,
            )
            for offset in range(0, nbytes, piece)
        ]
    )


def _copy_piece(
    destination: _Mapping, offset: int, source_address: int, nbytes: int, fresh: bool
) -> None:
    if fresh:
        destination.populate(offset, nbytes)  # (if refused, the copy faults them in)
    ctypes.memmove(destination.address + offset, source_address, nbytes)


def _create_probe() -> Segment | None:
    """A one-page segment whose serial (random: no pool's count reaches it in practice)
    only we know until a peer is told it."""
    try:
        return _create_segment(GRANULE, secrets.randbits(31) | 1 << 31)
    except OSError as exc:
        log.warning("cannot create a shared-memory segment (%s); using the socket", exc)
        return None


def open_probe(pid: int, key: int) -> str | None:
    """Open and map the probe segment ``key`` of process ``pid``, as its segments would
    be: None if that works, else why not."""
    try:
        _map_segment(pid, ExternalRef(key, 1))
    except (RemoteProtocolError, OSError) as exc:
        return f"probe segment not mapped: {exc}"
    return None


def _create_segment(capacity: int, serial: int) -> Segment:
    """A memfd named after ``serial`` (receivers check it) and sized, but not mapped:
    that, and faulting its pages in, happen in ``fill``, off the event loop."""
    fd = os.memfd_create(f"{_MEMFD_NAME}-{serial}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
    except BaseException:
        os.close(fd)
        raise
    return Segment(serial << _FD_BITS | fd, fd, capacity)


class SegmentMapper:
    """The receiver's side: maps a peer's segments once and hands out views of them.

    Up to ``max_cached_bytes`` of mappings stay cached, least recently used first
    out (the newest always stays); a mapping dropped while a tensor still uses it
    lives on until that dies.  ``forget`` drops the mappings of segments the
    sender closed.
    """

    def __init__(self, pid: int, max_cached_bytes: int = DEFAULT_BUDGET) -> None:
        self.pid = pid
        self.max_cached_bytes = max_cached_bytes
        self.cached_bytes = 0
        self._cache: OrderedDict[int, _Mapping] = OrderedDict()

    def view(self, ref: ExternalRef, on_release: Callable[[int], None]) -> memoryview:
        """Bytes of ``ref``, as storage for a tensor; ``on_release(key)`` runs once
        nothing uses them any more."""
        mapping = self._cache.get(ref.key)
        if mapping is None:
            mapping = self._cache[ref.key] = self._map(ref)
            self.cached_bytes += mapping.nbytes
            self._evict()
        else:
            self._cache.move_to_end(ref.key)
        if not 0 < ref.nbytes <= mapping.nbytes:
            raise RemoteProtocolError(f"segment reference of {ref.nbytes} bytes is out of range")
        return mapping.view(ref.nbytes, _Lease(lambda: on_release(ref.key)))

    def forget(self, keys: Iterable[int]) -> None:
        """The sender closed these segments: stop caching their mappings."""
        dropped = [m for m in (self._cache.pop(key, None) for key in keys) if m is not None]
        self.cached_bytes -= sum(m.nbytes for m in dropped)
        housekeeper.drop(dropped)

    def clear(self) -> None:
        dropped = list(self._cache.values())
        self._cache.clear()
        self.cached_bytes = 0
        housekeeper.drop(dropped)

    def _map(self, ref: ExternalRef) -> _Mapping:
        return _map_segment(self.pid, ref)

    def _evict(self) -> None:
        dropped = []
        while len(self._cache) > 1 and self.cached_bytes > self.max_cached_bytes:
            dropped.append(self._cache.popitem(last=False)[1])
            self.cached_bytes -= dropped[-1].nbytes
        housekeeper.drop(dropped)


def _map_segment(pid: int, ref: ExternalRef) -> _Mapping:
    """Open process ``pid``'s segment of ``ref`` (nothing but a memfd of that name is
    opened, and what was opened is checked too: the number may name another file by
    then), and map it."""
    fd_number = ref.key & ((1 << _FD_BITS) - 1)
    path = f"/proc/{pid}/fd/{fd_number}"
    name = f"/memfd:{_MEMFD_NAME}-{ref.key >> _FD_BITS}"
    try:
        if _memfd_name(path) != name:
            raise RemoteProtocolError(f"{path} is not an asyncrpc segment of that key")
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise RemoteProtocolError(f"cannot open shared-memory segment {path}: {exc}") from exc
    try:
        if _memfd_name(f"/proc/self/fd/{fd}") != name:
            raise RemoteProtocolError(f"{path} is not an asyncrpc segment of that key")
        size = os.fstat(fd).st_size
        if not 0 < ref.nbytes <= size:
            raise RemoteProtocolError(f"segment {path} does not hold {ref.nbytes} bytes")
        return _Mapping(fd, size, populate=False)
    finally:
        os.close(fd)


def _memfd_name(path: str) -> str:
    """What the descriptor at ``path`` (under ``/proc``) names, without " (deleted)"."""
    return os.readlink(path).split(" ", 1)[0]
