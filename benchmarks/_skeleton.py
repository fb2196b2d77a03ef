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


class SkeletonServer(asyncio.Protocol):
    """Runs each call: an ``async def`` as a task, a plain function in a pool thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.buffer = bytearray()
        self.jobs: queue.SimpleQueue[tuple[int, Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self.results: deque[tuple[int, Any]] = deque()
        self.lock = threading.Lock()
        self.drain_scheduled = False
        for _ in range(POOL_THREADS):
            threading.Thread(target=self.work, daemon=True).start()

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
                self.jobs.put((call_id, function, args))

    def work(self) -> None:
        while True:
            call_id, function, args = self.jobs.get()
            self.results.append((call_id, function(*args)))
            with self.lock:
                if self.drain_scheduled:
                    continue
                self.drain_scheduled = True
            self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        with self.lock:
            self.drain_scheduled = False
        while self.results:
            self.reply(*self.results.popleft())

    def reply(self, call_id: int, result: Any) -> None:
        self.transport.write(frame(call_id, result))

    def connection_lost(self, exc: Exception | None) -> None:
        self.loop.stop()


class SkeletonClient(asyncio.Protocol):
    """Pickles each call into a frame and resolves its future when its reply comes."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.buffer = bytearray()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.next_id = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def call(self) -> asyncio.Future[Any]:
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        self.transport.write(frame(self.next_id, (self.function, (), {})))
        return future

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        replies, used = frames(self.buffer)
        del self.buffer[:used]
        for call_id, result in replies:
            self.pending.pop(call_id).set_result(result)


def spin_forever(loop: asyncio.AbstractEventLoop) -> None:
    """Keep the loop turning: each turn polls the sockets with a zero timeout."""
    os.sched_yield()
    loop.call_soon(spin_forever, loop)
