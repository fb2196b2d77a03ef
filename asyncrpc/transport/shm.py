"""Same-host fast path: large buffers travel through pooled shared-memory segments.

Theory of operation
-------------------
Through a socket a buffer is copied twice (into the kernel, out of it) and the
receiver faults in fresh pages.  Between processes of one host we do better:

* The sender copies the bytes once into a *segment* (a ``memfd`` it maps) and
  sends only ``ExternalRef(key=fd, nbytes)`` in the frame.
* The receiver opens ``/proc/<sender pid>/fd/<fd>`` (the kernel lets only the
  same user do so), maps it, closes the descriptor, and the mapping itself
  becomes the tensor's storage: no second copy.
* When that tensor dies, the mapping is unmapped and the receiver tells the
  sender (a RELEASE message) that the segment is free; the sender reuses it.
  Reused segments are already faulted in, so a warm transfer costs one memcpy.

A segment is reused only after its receiver released it, so the receiver never
sees its tensor change.  When a link is lost its in-use segments are closed on
the sender's side and never reused: a still-living receiver keeps its mapping.
Idle segments beyond ``max_idle_bytes`` are closed, largest first.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
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


class _Mapping:
    """Owns one ``mmap`` made through libc, so that it holds no file descriptor (Python's
    ``mmap.mmap`` keeps a duplicate open for the mapping's whole life).  Unmapped when
    collected, and ``on_unmap`` runs then."""

    def __init__(self, address: int, nbytes: int, on_unmap: Callable[[], None] | None) -> None:
        self.address, self.nbytes, self._on_unmap = address, nbytes, on_unmap

    def __del__(self) -> None:
        _libc.munmap(self.address, self.nbytes)
        if self._on_unmap is not None:
            self._on_unmap()


def _map(fd: int, nbytes: int, on_unmap: Callable[[], None] | None = None) -> memoryview:
    """Map ``nbytes`` of ``fd`` shared and pre-faulted; the returned view owns the mapping.

    Ownership runs one way only (view -> ctypes array -> _Mapping), so the mapping is
    freed the moment the last view or tensor on it dies, without waiting for the GC.
    """
    flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
    address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address in (None, _MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
    array = (ctypes.c_char * nbytes).from_address(address)
    array._mapping = _Mapping(address, nbytes, on_unmap)  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


@dataclass(slots=True)
class _Segment:
    fd: int
    capacity: int
    memory: memoryview

    def close(self) -> None:
        self.memory.release()
        os.close(self.fd)


class SegmentPool:
    """The sender's side: segments to copy outgoing buffers into.  Thread-safe."""

    def __init__(self, max_idle_bytes: int = 2 << 30) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: list[_Segment] = []
        self._in_use: dict[int, tuple[_Segment, object]] = {}

    def put(self, data: memoryview, owner: object) -> ExternalRef:
        """Copy ``data`` into a segment lent to ``owner`` (a link); returns its reference."""
        nbytes = len(data)
        with self._lock:
            segment = self._take_idle(nbytes)
        if segment is None:
            segment = _create_segment(nbytes)
        _copy_into(segment.memory, data)
        with self._lock:
            self._in_use[segment.fd] = (segment, owner)
        return ExternalRef(segment.fd, nbytes)

    def release(self, keys: list[int], owner: object) -> None:
        """The receiver on ``owner`` unmapped these segments: they may be reused."""
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


def _copy_into(destination: memoryview, source: memoryview) -> None:
    """memcpy through ctypes, which lets go of the GIL for the copy (slice assignment
    would hold it, stalling the event loop while a pool thread copies megabytes)."""
    if source.readonly:
        destination[: len(source)] = source
        return
    source_address = ctypes.addressof(ctypes.c_char.from_buffer(source))
    ctypes.memmove(
        ctypes.addressof(ctypes.c_char.from_buffer(destination)), source_address, len(source)
    )


def _create_segment(nbytes: int) -> _Segment:
    capacity = -(-nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("asyncrpc-segment", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        memory = _map(fd, capacity)
    except BaseException:
        os.close(fd)
        raise
    return _Segment(fd, capacity, memory)


def map_segment(pid: int, ref: ExternalRef, on_release: Callable[[int], None]) -> memoryview:
    """The receiver's side: map the sender's segment as a writable byte view.

    The view (and whatever is built on it, e.g. a tensor) keeps the mapping alive;
    ``on_release(key)`` runs once the last of them is gone and it is unmapped."""
    path = f"/proc/{pid}/fd/{ref.key}"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise RemoteProtocolError(f"cannot open shared-memory segment {path}: {exc}") from exc
    try:
        if not os.readlink(path).startswith("/memfd:asyncrpc-segment"):
            raise RemoteProtocolError(f"{path} is not an asyncrpc segment")
        if not 0 < ref.nbytes <= os.fstat(fd).st_size:
            raise RemoteProtocolError(f"segment {path} does not hold {ref.nbytes} bytes")
        return _map(fd, ref.nbytes, lambda: on_release(ref.key))
    finally:
        os.close(fd)
