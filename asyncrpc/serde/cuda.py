"""CUDA tensors on the wire: stream-ordered copies, and CUDA IPC between processes of a host.

Theory of operation
-------------------
Nothing here synchronises a device, and the event loop never waits for a GPU.

*Sending.*  A CUDA tensor leaves in one of two ways, chosen by its message's
:class:`~asyncrpc.serde.devices.CudaRoute`:

* **CUDA IPC** (the peer shares this host's memory and sees the tensor's GPU):
  the payload carries torch's IPC handle of the tensor's storage
  (``UntypedStorage._share_cuda_``).  torch records an event on the current
  stream with it, and keeps the memory alive, reference-counted in shared
  memory, until the receiver lets it go (torch's own bookkeeping, the one
  ``torch.multiprocessing`` uses; :func:`torch.cuda.ipc_collect` frees what
  receivers released, and runs here at most once a second).  No byte goes
  through the host.
* **Host staging**: a side stream waits for the current stream (the one that
  produced the tensor) and copies the bytes into pinned host memory from torch's
  caching host allocator (a pool); the tensor is marked as used by that stream,
  so the allocator cannot reuse it before the copy ran.  The copy's event goes
  to the message's ``staged`` list: the agent writes the message once the event
  has fired, waiting off the loop (see ``Outgoing.wait_staged``).  Without a
  list (a value serialised outside a message) the copy is waited for at once.

*Receiving.*  A staged tensor's bytes arrive in host memory; a receive stream
copies them to the target device into memory allocated for that stream, and the
current stream waits for the copy (an event wait on the GPU, not on the host).
An IPC tensor is opened with the sender's event waited for on an IPC stream, and
copied on that stream into memory of its own on the target device (a received
tensor never lives in a peer's memory: the peer may die, and the device map may
name another GPU); the current stream waits for the copy, and the peer's memory is
let go by a releaser thread once the copy is done (torch's release synchronises the
stream current in the releasing thread, which must not be the loop's).  The
releaser keeps the latest small storage of each peer segment open for a moment
(:class:`KeptMappings`), so that the next tensor from that segment is opened
without mapping it again; a worker leaving the job lets go of all of it
(:func:`let_go_of_peers`), and then frees what its peers let go of
(:func:`collect_released`).  Code that runs on the received tensors on the
current stream is ordered after the data, with no device-wide synchronisation;
code on another stream orders itself, as in torch.

Sends, receives and IPC copies use separate streams (one of each per device): a
copy from pageable host memory waits for its stream's earlier work, which must
not include a peer's kernel.  A fourth, idle, is current while peers' storages are
let go (torch synchronises that stream then, holding the GIL).  :func:`stats`
counts tensors and bytes by path, for ``get_debug_info()["cuda"]``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

import torch

from asyncrpc.errors import SerializationError
from asyncrpc.serde.devices import CudaRoute

log = logging.getLogger("asyncrpc.cuda")
Shared = tuple[Any, ...]  # what load_shared needs: the GPU, torch's IPC tuple, the span

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_counts: Counter[str] = Counter()
_gpus: dict[int, str] | None = None
_lock = threading.Lock()
_last_collect = 0.0
_COLLECT_EVERY = 1.0  # seconds between torch.cuda.ipc_collect() calls, at most


Destination = tuple[CudaRoute | None, list[Any] | None]


def _nowhere() -> Destination:
    return None, None


destination: Callable[[], Destination] = _nowhere
"""The route and the staged-copy list of the message being serialised in this thread
(set by the layer that sends messages: see :func:`set_destination`)."""


def set_destination(find: Callable[[], Destination]) -> None:
    """Tell serde how to find the current message's route and staged list."""
    global destination
    destination = find


def stats() -> dict[str, int]:
    """Tensors and bytes sent and received, by path, since the process started, and the
    bytes of peers' memory kept open (see :class:`KeptMappings`)."""
    return {**dict(sorted(_counts.items())), "ipc_kept_bytes": _kept.kept_bytes}


def device_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_uuids() -> dict[int, str]:
    """Each visible CUDA device's GPU UUID (initialises CUDA)."""
    global _gpus
    if _gpus is None:
        _gpus = {
            i: str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())
        }
    return _gpus


_ROLES = ("send", "receive", "ipc", "release")


def prepare(devices: Sequence[str]) -> None:
    """Make what the first CUDA tensors to and from ``devices`` would otherwise make on
    their way (side streams, the releaser thread), so that a first call is not slower."""
    for name in devices:
        for role in _ROLES:
            _stream(torch.device(name).index or 0, role)
    if devices:
        _releaser()


def _stream(index: int, role: str) -> torch.cuda.Stream:
    """This process's ``role`` stream of device ``index``: "send", "receive", "ipc", or
    "release", which never has work (see :func:`_release_forever`)."""
    key = (index, role)
    found = _streams.get(key)
    if found is None:
        with _lock:
            found = _streams.setdefault(key, torch.cuda.Stream(index))  # type: ignore[no-untyped-call]
    return found


def _bytes_of(data: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    return data.reshape(-1).view(torch.uint8)


def dump_cuda(
    data: torch.Tensor, route: CudaRoute | None, staged: list[Any] | None
) -> tuple[str, Any]:
    """A contiguous CUDA tensor ``data`` leaving by ``route``: ``("ipc", shared)`` or
    ``("bytes", pinned uint8 tensor)``."""
    device = str(data.device)
    nbytes = data.numel() * data.element_size()
    if route is not None and device in route.ipc and nbytes:
        shared = _share(data, nbytes)
        if shared is not None:
            _count("sent_ipc", nbytes)
            return "ipc", shared
    _count("sent_staged", nbytes)
    return "bytes", _stage(data, nbytes, staged)


def _count(path: str, nbytes: int) -> None:
    _counts[f"{path}_tensors"] += 1
    _counts[f"{path}_bytes"] += nbytes


def _stage(data: torch.Tensor, nbytes: int, staged: list[Any] | None) -> torch.Tensor:
    """Copy ``data`` to pinned host memory on the send stream, after the current stream."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if not nbytes:
        return pinned
    index = data.device.index or 0
    side = _stream(index, "send")
    side.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(side):
        pinned.copy_(_bytes_of(data), non_blocking=True)
        done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        done.record(side)
    data.record_stream(side)
    if staged is None:
        done.synchronize()
    else:
        staged.append(done)
    return pinned


def _share(data: torch.Tensor, nbytes: int) -> Shared | None:
    """torch's IPC handle of ``data``'s storage (an event recorded on the current
    stream), with where ``data`` lies in it; None where the memory cannot be shared
    (not from torch's caching allocator, say)."""
    try:
        shared = data.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    except RuntimeError:
        return None
    _collect_released()
    uuid = gpu_uuids()[data.device.index or 0]
    return (uuid, *shared[1:], data.storage_offset() * data.element_size(), nbytes)


def _collect_released() -> None:
    """Free what receivers released (torch keeps sent memory until it is collected)."""
    global _last_collect
    now = time.monotonic()
    if now - _last_collect >= _COLLECT_EVERY:
        _last_collect = now
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


def synchronize(events: Sequence[Any]) -> None:
    """Wait (blocking this thread, not spinning) until every event has fired."""
    for event in events:
        event.synchronize()


def all_done(events: Sequence[Any]) -> bool:
    """Whether every event has fired (never waits)."""
    return all(event.query() for event in events)


_devices: dict[str, torch.device] = {}


def device_of(name: str) -> torch.device:
    """The local CUDA device ``name``; SerializationError if this worker lacks it."""
    device = _devices.get(name)
    if device is None:
        device = torch.device(name)
        if (device.index or 0) >= device_count():
            raise SerializationError(
                f"received a tensor for device {name!r}, which this worker lacks"
            )
        _devices[name] = device
    return device


def upload(raw: torch.Tensor, name: str) -> torch.Tensor:
    """Host bytes ``raw`` copied to device ``name`` on the receive stream; the current
    stream waits for the copy."""
    device = device_of(name)
    side = _stream(device.index or 0, "receive")
    with torch.cuda.stream(side):
        dest = torch.empty(raw.numel(), dtype=torch.uint8, device=device)
        dest.copy_(raw, non_blocking=True)
        done = side.record_event()
    _hand_over(dest, done, device)
    _count("received_staged", raw.numel())
    return dest


def _hand_over(dest: torch.Tensor, copied: Any, device: torch.device) -> None:
    """Order the current stream after the copy into ``dest`` (its event ``copied``);
    ``dest`` is then the current stream's to use and free."""
    current = torch.cuda.current_stream(device)
    current.wait_event(copied)
    dest.record_stream(current)


def load_shared(shared: Shared, name: str) -> torch.Tensor:
    """The bytes a peer shared by CUDA IPC, copied to device ``name`` (uint8)."""
    uuid, *handle, start, nbytes = shared
    source = _local_index(str(uuid))
    device = device_of(name)
    src_stream = _stream(source, "ipc")
    dst_stream = _stream(device.index or 0, "ipc")
    try:
        with _streams_of(src_stream, dst_stream):
            storage = torch.UntypedStorage._new_shared_cuda(source, *handle)
            mapped = torch.empty(0, dtype=torch.uint8, device=f"cuda:{source}")
            mapped.set_(storage, start, (nbytes,), (1,))
            dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dest.copy_(mapped, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(dst_stream)
    except RuntimeError as exc:
        raise SerializationError(f"cannot open a CUDA tensor shared by CUDA IPC: {exc}") from exc
    _hand_over(dest, done, device)
    held = [storage, mapped]  # the releaser empties it: the last reference dies there
    del storage, mapped
    segment = (uuid, handle[0])
    _releaser().put((done, held, _stream(source, "release"), segment, int(handle[1])))
    _count("received_ipc", nbytes)
    return dest


def _streams_of(source: torch.cuda.Stream, target: torch.cuda.Stream) -> ExitStack:
    """Both streams current on their devices (one, if they are the same)."""
    stack = ExitStack()
    stack.enter_context(torch.cuda.stream(source))
    if target is not source:
        stack.enter_context(torch.cuda.stream(target))
    return stack


def _local_index(uuid: str) -> int:
    for index, found in gpu_uuids().items():
        if found == uuid:
            return index
    raise SerializationError(
        f"received a CUDA tensor shared by CUDA IPC from GPU {uuid}, which this worker "
        "does not see (CUDA_VISIBLE_DEVICES?)"
    )


class KeptMappings:
    """The peers' storages kept open after their copy, newest per peer memory segment.

    Opening a peer's segment (``cudaIpcOpenMemHandle``) and closing it again cost
    about a millisecond, far more than copying tens of megabytes on the GPU, and torch
    keeps a segment open while any storage of it is alive here.  So the latest storage
    of each segment is kept, until a newer one of the same segment replaces it, it is
    ``keep_for`` seconds old, or room is needed: at most ``max_kept`` storages and
    ``max_bytes`` bytes (a larger storage is let go at once).  A kept storage holds
    that much of the peer's memory (torch frees it once let go), so ``max_bytes``
    bounds what one worker holds of its peers'.  Pure bookkeeping: :meth:`keep` and
    :meth:`expired` return what to let go.
    """

    def __init__(self, max_kept: int = 16, max_bytes: int = 256 << 20, keep_for: float = 2.0):
        self.max_kept = max_kept
        self.max_bytes = max_bytes
        self.keep_for = keep_for
        self.kept_bytes = 0
        self._kept: dict[Hashable, tuple[float, int, Any]] = {}  # oldest first

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key: Hashable | None, item: Any, nbytes: int, now: float) -> list[Any]:
        """``item`` (a storage of ``nbytes`` in segment ``key``) was copied: what to let
        go now (``item`` itself, if it is not kept)."""
        if key is None or nbytes > self.max_bytes:
            return [item]
        gone = [self._drop(key)] if key in self._kept else []
        self._kept[key] = (now, nbytes, item)
        self.kept_bytes += nbytes
        while len(self._kept) > self.max_kept or self.kept_bytes > self.max_bytes:
            gone.append(self._drop(next(iter(self._kept))))
        return gone + self.expired(now)

    def expired(self, now: float) -> list[Any]:
        """What has been kept ``keep_for`` seconds or more."""
        stale = [key for key, (since, _, _) in self._kept.items() if now - since >= self.keep_for]
        return [self._drop(key) for key in stale]

    def let_go_of_all(self) -> list[Any]:
        """Everything kept, to let go now (see :func:`let_go_of_peers`)."""
        return [self._drop(key) for key in list(self._kept)]

    def _drop(self, key: Hashable) -> Any:
        _, nbytes, item = self._kept.pop(key)
        self.kept_bytes -= nbytes
        return item


_kept = KeptMappings()  # the releaser thread's

# (copy done, what to let go, the stream to release it on, its segment, its size), or
# a future to settle once everything kept and queued before it was let go (let_go_of_peers)
Release = tuple[Any, list[Any], torch.cuda.Stream, Hashable | None, int]
_release_queue: queue.SimpleQueue[Release | Future[None]] | None = None


def let_go_of_peers() -> Future[None] | None:
    """Let go of every peer storage this worker holds open: the releaser thread does,
    after the copies queued before; a future done once it has (None where there is
    nothing to let go: no peer ever shared any here).

    A worker leaving the job calls it before its last barrier, and
    :func:`collect_released` after it.  torch keeps the memory a worker sent by CUDA
    IPC until every receiver let it go; what it still keeps when the process exits is
    freed while the CUDA runtime unloads, and where that memory holds a received
    tensor (which carries a stream use) torch cannot record the stream's event then,
    and aborts the process (``cudaErrorCudartUnloading`` in the caching allocator)."""
    if _release_queue is None:
        return None
    released: Future[None] = Future()
    _release_queue.put(released)
    return released


def collect_released() -> None:
    """Free the memory this worker sent by CUDA IPC that every receiver has let go
    (``torch.cuda.ipc_collect``); nothing in a worker that never sent any.  A CUDA
    error is logged: a worker that is closing must still close."""
    if _counts["sent_ipc_tensors"]:
        try:
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        except RuntimeError:
            log.exception("freeing the CUDA memory peers let go of failed")


def _releaser() -> queue.SimpleQueue[Release | Future[None]]:
    """The queue of a daemon thread that lets peers' memory go once copied."""
    global _release_queue
    with _lock:
        if _release_queue is None:
            _release_queue = queue.SimpleQueue()
            threading.Thread(
                target=_release_forever,
                args=(_release_queue, _kept),
                name="asyncrpc-cuda-release",
                daemon=True,
            ).start()
    return _release_queue


def _release_forever(jobs: queue.SimpleQueue[Release | Future[None]], kept: KeptMappings) -> None:
    """Let peers' storages go once their copies are done.  torch's release of a storage
    synchronises the stream current in the releasing thread, with the GIL held: made
    current here is the idle release stream, never one that may wait on a peer.  An
    error (a CUDA one, say) is logged and ends that job only: the thread goes on."""
    while True:
        try:
            job: Release | Future[None] | None = jobs.get(timeout=kept.keep_for)
        except queue.Empty:
            job = None
        try:
            _release(job, kept)
        except Exception:
            log.exception("letting go of a peer's CUDA memory failed")


def _release(job: Release | Future[None] | None, kept: KeptMappings) -> None:
    """One job of the releaser: a copy done (``Release``), everything (a future, from
    :func:`let_go_of_peers`, settled in the end whatever happens, unless its waiter
    gave up) or what expired (None)."""
    if job is None:
        _let_go(kept.expired(time.monotonic()))
    elif isinstance(job, Future):
        awaited = job.set_running_or_notify_cancel()
        try:
            _let_go(kept.let_go_of_all())
        finally:
            if awaited:
                job.set_result(None)
    else:
        done, held, stream, segment, nbytes = job
        done.synchronize()
        _let_go(kept.keep(segment, (held, stream), nbytes, time.monotonic()))


def _let_go(gone: list[Any]) -> None:
    for held, on_stream in gone:
        try:
            with torch.cuda.stream(on_stream):
                held.clear()
        except Exception:  # (the others still go)
            log.exception("letting go of a peer's CUDA memory failed")
