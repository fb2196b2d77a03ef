"""The skeleton of a Python RPC: the least such a framework does per call.

The caller pickles ``(function, args, kwargs)`` into a length-prefixed frame with a call
id and keeps a future per call id; the server unpickles it, runs an ``async def`` as a
task on its loop or a plain function in a pool thread (four threads, a queue, one
``call_soon_threadsafe`` per batch of results, as torch runs plain functions in its
thread pool), and pickles the result into a frame; the caller resolves the future.  No
authentication, limits, deadlines, metrics, notices, shared memory or error handling.

``latency_floor.py`` times it beside bare sockets; ``_floor_worker.py`` runs
``bench_rpc.py``'s small-call workloads over it, so that a run shows what a Python RPC
cannot go below in the same rounds as torch and asyncrpc.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import queue
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

HEADER = struct.Struct("<IQ")  # the skeleton's frame: payload length, call id
POOL_THREADS = 4


async def coroutine_noop() -> None:
    return None


def plain_noop() -> None:
    return None


_barriers: dict[int, asyncio.Barrier] = {}


async def rendezvous(parties: int) -> None:
    """Return once ``parties`` callers are in here (on the server's loop): clients that
    measure together start together."""
    barrier = _barriers.setdefault(parties, asyncio.Barrier(parties))
    await barrier.wait()


def frames(buffer: bytearray) -> tuple[list[tuple[int, Any]], int]:
    """The complete frames at the start of ``buffer``, unpickled, and the bytes they take."""
    found, offset = [], 0
    while len(buffer) - offset >= HEADER.size:
        length, call_id = HEADER.unpack_from(buffer, offset)
        end = offset + HEADER.size + length
        if len(buffer) < end:
            break
        found.append((call_id, pickle.loads(memoryview(buffer)[offset + HEADER.size : end])))
        offset = end
    return found, offset


def frame(call_id: int, value: Any) -> bytes:
    payload = pickle.dumps(value, protocol=5)
    return HEADER.pack(len(payload), call_id) + payload


class SkeletonPool:
    """The thread pool that runs a server's plain calls, shared by its connections:
    ``POOL_THREADS`` threads, a job queue, one ``call_soon_threadsafe`` per batch of
    results."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.results: deque[tuple[SkeletonServer, int, Any]] = deque()
        self.lock = threading.Lock()
        self.drain_scheduled = False
        for _ in range(POOL_THREADS):
            threading.Thread(target=self.work, daemon=True).start()

    def work(self) -> None:
        while True:
            server, call_id, function, args = self.jobs.get()
            self.results.append((server, call_id, function(*args)))
            with self.lock:
                if self.drain_scheduled:
                    continue
                self.drain_scheduled = True
            self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        with self.lock:
            self.drain_scheduled = False
        while self.results:
            server, call_id, result = self.results.popleft()
            server.reply(call_id, result)


class SkeletonServer(asyncio.Protocol):
    """Runs each call: an ``async def`` as a task, a plain function in a pool thread.
    ``pool``: shared with the server's other connections (default: one of its own);
    ``on_lost``: what the caller hanging up does (default: stop the loop)."""

    def __init__(
        self, pool: SkeletonPool | None = None, on_lost: Callable[[], None] | None = None
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool = pool or SkeletonPool(self.loop)
        self.on_lost = on_lost or self.loop.stop
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        calls, used = frames(self.buffer)
        del self.buffer[:used]
        for call_id, (function, args, kwargs) in calls:
            if asyncio.iscoroutinefunction(function):
                task = self.loop.create_task(function(*args, **kwargs))
                task.add_done_callback(lambda done, i=call_id: self.reply(i, done.result()))
            else:
                self.pool.jobs.put((self, call_id, function, args))

    def reply(self, call_id: int, result: Any) -> None:
        self.transport.write(frame(call_id, result))

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost()


Job = tuple[SkeletonServer, int, Callable[..., Any], tuple[Any, ...]]
"""A plain call for the pool: the connection it came in on, its id, the function and
its arguments."""


class SkeletonClient(asyncio.Protocol):
    """Pickles each call into a frame and resolves its future when its reply comes."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.buffer = bytearray()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.next_id = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def call(self, *args: Any) -> asyncio.Future[Any]:
        """Call ``self.function(*args)`` on the server; a future of its result."""
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        self.transport.write(frame(self.next_id, (self.function, args, {})))
        return future

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        replies, used = frames(self.buffer)
        del self.buffer[:used]
        for call_id, result in replies:
            self.pending.pop(call_id).set_result(result)


class Spinner:
    """Keeps a loop turning while on: each turn yields the CPU (``sched_yield``) and
    polls the sockets with a zero timeout, as asyncrpc's poller does after activity."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.Handle | None = None

    def start(self) -> None:
        if self._handle is None:
            self._turn()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _turn(self) -> None:
        os.sched_yield()
        self._handle = self._loop.call_soon(self._turn)
