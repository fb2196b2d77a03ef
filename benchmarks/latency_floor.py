"""The floor of a small round trip between two Python processes here, measured without asyncrpc.

``bench_rpc.py``'s no-op targets (plain 4x, coroutine 8x, pipelined 10x torch) ask for
round trips of a few tens of microseconds.  This script measures what two processes on
this machine pay for one round trip over a Unix socketpair when they do nothing else,
from the bare system calls up to the skeleton of an RPC framework:

* ``blocking sockets``: ``send``/``recv`` of 64 bytes in a loop on both sides;
* ``uvloop protocols``: both sides run uvloop; the server's ``data_received`` writes
  the bytes back, the client writes and awaits a future set by its ``data_received``
  (the least any asyncio RPC does per call);
* ``uvloop + busy-poll``: the same while each loop keeps turning between messages
  (``call_soon`` plus ``sched_yield``), as asyncrpc's poller does after activity;
* ``uvloop, 256 in flight``: the client keeps 256 calls outstanding as
  ``bench_rpc.py``'s pipelined no-op does (a semaphore, a done callback per call);
  the time per call;
* ``skeleton RPC, ...``: the least a Python RPC does per call, in about 60 lines
  (``_skeleton.py`` says what it does and leaves out).  Sequential with busy-polling
  (as ``bench_rpc.py``'s no-op rows), and 256 in flight (its pipelined row).  It is
  what a Python framework on this machine cannot go below, which tells how far
  asyncrpc's own work per message is from it.  ``bench_rpc.py`` runs it too, as its
  ``floor``, in the same rounds as both frameworks.

Each is the median of ``--rounds`` rounds of ``--calls`` round trips (every round is
printed).  Usage: ``python benchmarks/latency_floor.py [--calls 20000] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvloop
from _skeleton import SkeletonClient, SkeletonServer, Spinner, coroutine_noop, plain_noop

MESSAGE = b"x" * 64


def blocking_server(sock: socket.socket) -> None:
    while data := sock.recv(65536):
        sock.sendall(data)


def blocking_client(sock: socket.socket, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        sock.sendall(MESSAGE)
        sock.recv(65536)
    return (time.perf_counter() - start) / calls


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        asyncio.get_running_loop().stop()


class Caller(asyncio.Protocol):
    """Counts replies by bytes (64 per call) and resolves one future per call."""

    def __init__(self) -> None:
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.buffered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffered += len(data)
        while self.buffered >= len(MESSAGE):
            self.buffered -= len(MESSAGE)
            self.waiting.popleft().set_result(None)

    def call(self) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(MESSAGE)
        return future


# -- running a kind in a fresh pair of processes ----------------------------------------


@dataclass(frozen=True)
class Kind:
    """One measurement: the server's protocol, the client's, busy-polling, calls in flight."""

    server: Callable[[], asyncio.Protocol]
    client: Callable[[], Caller | SkeletonClient]
    poll: bool
    in_flight: int


def loop_server(sock: socket.socket, kind: Kind) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(kind.server, sock)
        if kind.poll:
            Spinner(loop).start()
        await asyncio.Event().wait()

    with contextlib.suppress(RuntimeError):  # stopped when the client went away
        uvloop.run(serve())


async def loop_client(sock: socket.socket, calls: int, kind: Kind) -> float:
    loop = asyncio.get_running_loop()
    _, caller = await loop.connect_accepted_socket(kind.client, sock)
    if kind.poll:
        Spinner(loop).start()
    for _ in range(min(calls, 500)):  # warm up: the first calls pay for caches and threads
        await caller.call()
    start = time.perf_counter()
    if kind.in_flight == 1:
        for _ in range(calls):
            await caller.call()
    else:  # as bench_rpc.py's pipelined no-op: a semaphore, a done callback per call
        window = asyncio.Semaphore(kind.in_flight)
        for _ in range(calls):
            await window.acquire()
            caller.call().add_done_callback(lambda _: window.release())
        for _ in range(kind.in_flight):
            await window.acquire()
    return (time.perf_counter() - start) / calls


def one_round(name: str, calls: int) -> float:
    """Seconds per call of the kind ``name``, in a fresh pair of processes."""
    ours, theirs = socket.socketpair()
    kind = KINDS.get(name)
    child = os.fork()
    if child == 0:
        ours.close()
        if kind is None:
            blocking_server(theirs)
        else:
            loop_server(theirs, kind)
        os._exit(0)
    theirs.close()
    try:
        if kind is None:
            return blocking_client(ours, calls)
        return uvloop.run(loop_client(ours, calls, kind))
    finally:
        ours.close()
        os.waitpid(child, 0)


def skeleton(function: Callable[..., Any]) -> Callable[[], SkeletonClient]:
    return lambda: SkeletonClient(function)


KINDS: dict[str, Kind] = {
    "uvloop protocols": Kind(Echo, Caller, poll=False, in_flight=1),
    "uvloop + busy-poll": Kind(Echo, Caller, poll=True, in_flight=1),
    "uvloop, 256 in flight": Kind(Echo, Caller, poll=False, in_flight=256),
    "skeleton RPC, async def, busy-poll": Kind(
        SkeletonServer, skeleton(coroutine_noop), poll=True, in_flight=1
    ),
    "skeleton RPC, pool thread, busy-poll": Kind(
        SkeletonServer, skeleton(plain_noop), poll=True, in_flight=1
    ),
    "skeleton RPC, pool thread, 256 in flight": Kind(
        SkeletonServer, skeleton(plain_noop), poll=False, in_flight=256
    ),
}
NAMES = ("blocking sockets", *KINDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tries: dict[str, list[float]] = {name: [] for name in NAMES}
    for _ in range(args.rounds):  # alternating, so that a noisy moment hits every kind
        for name in NAMES:
            tries[name].append(one_round(name, args.calls) * 1e6)
    print(
        f"round trips between two processes, {args.rounds} rounds of {args.calls} "
        f"(µs per call), load {os.getloadavg()[0]:.2f}"
    )
    for name, us in tries.items():
        each = " ".join(f"{u:.1f}" for u in us)
        print(f"  {name:42s} median {statistics.median(us):6.1f}   [{each}]")


if __name__ == "__main__":
    main()
