"""Same-host fast path: large buffers travel through pooled shared-memory segments.

Theory of operation
-------------------
Through a socket a buffer is copied twice (into the kernel, out of it) and the
receiver faults in fresh pages.  Between processes of one host we do better:

* The sender copies the bytes once into a *segment* (a ``memfd`` it maps) and
  sends only ``ExternalRef(key, nbytes)`` in the frame.  A key is the segment's
  serial number (never reused by that process) and its descriptor number.
* The receiver opens ``/proc/<sender pid>/fd/<fd>`` the first time it sees a
  key (the kernel lets only the same user do so), maps the whole segment once,
  and keeps that mapping in a :class:`SegmentMapper` cache.  Each transfer is
  a *view* of the cached mapping that becomes the tensor's storage: no second
  copy, and no system call at all for a segment seen before.
* When the last tensor on a view dies, its lease tells the sender (a RELEASE
  message) that the segment is free; the sender reuses it.  Reused segments
  are faulted in on both sides, so a warm transfer costs one memcpy.

A segment is reused only after its receiver released it, so the receiver never
sees its tensor change.  When a link is lost its in-use segments are closed on
the sender's side and never reused: a still-living receiver keeps its mapping.
Idle segments beyond ``max_idle_bytes`` are closed, largest first.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.wire import ExternalRef

SHM_THRESHOLD: Final = 1 << 20
"""Buffers of at least this many bytes take the shared-memory path (see benchmarks/)."""
_ALIGN: Final = 2 << 20


def host_identity() -> str:
    """Processes with equal identities can share memory by descriptor."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"nohost-{os.getpid()}"  # unique: never matches another process
    return f"{boot}:{pidns}:{os.getuid()}"


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
_MAP_FAILED = ctypes.c_void_p(-1).value
_FD_BITS = 32


class _Mapping:
    """One ``mmap`` made through libc, so that it holds no file descriptor (Python's
    ``mmap.mmap`` keeps a duplicate open for the mapping's whole life).  Unmapped
    when the last reference goes."""

    def __init__(self, fd: int, nbytes: int) -> None:
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if address in (None, _MAP_FAILED):
            errno = ctypes.get_errno()
            raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
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

    def __del__(self) -> None:
        _libc.munmap(self.address, self.nbytes)


class _Lease:
    """Held by the views of one transfer; when they are all gone, the segment is free."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._on_release = on_release

    def __del__(self) -> None:
        self._on_release()


@dataclass(slots=True)
class _Segment:
    key: int
    fd: int
    capacity: int
    mapping: _Mapping

    def close(self) -> None:
        os.close(self.fd)  # the mapping goes with the last reference to it


class SegmentPool:
    """The sender's side: segments to copy outgoing buffers into.  Thread-safe."""

    def __init__(self, max_idle_bytes: int = 2 << 30) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: list[_Segment] = []
        self._in_use: dict[int, tuple[_Segment, object]] = {}
        self._serials = itertools.count(1)

    def put(self, data: memoryview, owner: object) -> ExternalRef:
        """Copy ``data`` into a segment lent to ``owner`` (a link); returns its reference."""
        nbytes = len(data)
        with self._lock:
            segment = self._take_idle(nbytes)
        if segment is None:
            segment = _create_segment(nbytes, next(self._serials))
        _copy_into(segment.mapping, data)
        with self._lock:
            self._in_use[segment.key] = (segment, owner)
        return ExternalRef(segment.key, nbytes)

    def release(self, keys: list[int], owner: object) -> None:
        """The receiver on ``owner`` is done with these segments: they may be reused."""
        with self._lock:
            for key in keys:
                entry = self._in_use.get(key)
                if entry is not None and entry[1] is owner:
                    del self._in_use[key]
                    self._idle.append(entry[0])
            self._trim()

    def forget(self, owner: object) -> None:
        """``owner`` is gone: close (never reuse) the segments lent to it."""
        with self._lock:
            lost = [key for key, (_, o) in self._in_use.items() if o is owner]
            segments = [self._in_use.pop(key)[0] for key in lost]
        for segment in segments:
            segment.close()

    def close(self) -> None:
        with self._lock:
            segments = self._idle + [s for s, _ in self._in_use.values()]
            self._idle, self._in_use = [], {}
        for segment in segments:
            segment.close()

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "segments_in_use": len(self._in_use),
                "segments_idle": len(self._idle),
                "idle_bytes": sum(s.capacity for s in self._idle),
            }

    def _take_idle(self, nbytes: int) -> _Segment | None:
        fits = [s for s in self._idle if nbytes <= s.capacity <= 2 * max(nbytes, _ALIGN)]
        if not fits:
            return None
        best = min(fits, key=lambda s: s.capacity)
        self._idle.remove(best)
        return best

    def _trim(self) -> None:
        self._idle.sort(key=lambda s: s.capacity)
        while self._idle and sum(s.capacity for s in self._idle) > self.max_idle_bytes:
            self._idle.pop().close()


def _copy_into(destination: _Mapping, source: memoryview) -> None:
    """memcpy through ctypes, which lets go of the GIL for the copy (slice assignment
    would hold it, stalling the event loop while a pool thread copies megabytes)."""
    if source.readonly:
        destination.view(len(source))[:] = source
        return
    source_address = ctypes.addressof(ctypes.c_char.from_buffer(source))
    ctypes.memmove(destination.address, source_address, len(source))


def _create_segment(nbytes: int, serial: int) -> _Segment:
    capacity = -(-nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("asyncrpc-segment", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        mapping = _Mapping(fd, capacity)
    except BaseException:
        os.close(fd)
        raise
    return _Segment(serial << _FD_BITS | fd, fd, capacity, mapping)


class SegmentMapper:
    """The receiver's side: maps a peer's segments once and hands out views of them.

    Up to ``max_cached_bytes`` of mappings stay cached, least recently used first
    out; a mapping evicted while a tensor still uses it lives on until that dies.
    """

    def __init__(self, pid: int, max_cached_bytes: int = 2 << 30) -> None:
        self.pid = pid
        self.max_cached_bytes = max_cached_bytes
        self._cache: OrderedDict[int, _Mapping] = OrderedDict()

    def view(self, ref: ExternalRef, on_release: Callable[[int], None]) -> memoryview:
        """Bytes of ``ref``, as storage for a tensor; ``on_release(key)`` runs once
        nothing uses them any more."""
        mapping = self._cache.get(ref.key)
        if mapping is None:
            mapping = self._cache[ref.key] = self._map(ref)
            self._evict()
        else:
            self._cache.move_to_end(ref.key)
        if not 0 < ref.nbytes <= mapping.nbytes:
            raise RemoteProtocolError(f"segment reference of {ref.nbytes} bytes is out of range")
        return mapping.view(ref.nbytes, _Lease(lambda: on_release(ref.key)))

    def clear(self) -> None:
        self._cache.clear()

    def _map(self, ref: ExternalRef) -> _Mapping:
        path = f"/proc/{self.pid}/fd/{ref.key & ((1 << _FD_BITS) - 1)}"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise RemoteProtocolError(f"cannot open shared-memory segment {path}: {exc}") from exc
        try:
            if not os.readlink(path).startswith("/memfd:asyncrpc-segment"):
                raise RemoteProtocolError(f"{path} is not an asyncrpc segment")
            size = os.fstat(fd).st_size
            if not 0 < ref.nbytes <= size:
                raise RemoteProtocolError(f"segment {path} does not hold {ref.nbytes} bytes")
            return _Mapping(fd, size)
        finally:
            os.close(fd)

    def _evict(self) -> None:
        while len(self._cache) > 1 and (
            sum(m.nbytes for m in self._cache.values()) > self.max_cached_bytes
        ):
            self._cache.popitem(last=False)
