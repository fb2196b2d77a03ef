"""The floor of a small round trip between two Python processes here, measured without RPC.

``bench_rpc.py``'s no-op targets (plain 4x, coroutine 8x, pipelined 10x torch) ask for
round trips of a few tens of microseconds.  This script measures what two processes on
this machine pay for one round trip of a 64-byte message over a Unix socketpair when
they do nothing else, from the bare system calls up to an asyncio skeleton of a call:

* ``blocking sockets``: ``send``/``recv`` in a loop on both sides (no event loop);
* ``uvloop protocols``: both sides run uvloop; the server's ``data_received`` writes
  the bytes back, the client writes and awaits a future set by its ``data_received``
  (the least any asyncio RPC does per call);
* ``uvloop + busy-poll``: the same while each loop keeps turning between messages
  (``call_soon`` plus ``sched_yield``), as asyncrpc's poller does after activity;
* ``uvloop, 256 in flight``: the client keeps 256 calls outstanding as
  ``bench_rpc.py``'s pipelined no-op does (a semaphore, a done callback per call);
  the time per call.

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
from collections.abc import Callable

import uvloop

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
        self.waiting: list[asyncio.Future[None]] = []
        self.buffered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffered += len(data)
        while self.buffered >= len(MESSAGE):
            self.buffered -= len(MESSAGE)
            self.waiting.pop(0).set_result(None)

    def call(self) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(MESSAGE)
        return future


def spin_forever(loop: asyncio.AbstractEventLoop) -> None:
    """Keep the loop turning: each turn polls the sockets with a zero timeout."""
    os.sched_yield()
    loop.call_soon(spin_forever, loop)


def loop_server(sock: socket.socket, poll: bool) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(Echo, sock)
        if poll:
            spin_forever(loop)
        await asyncio.Event().wait()

    with contextlib.suppress(RuntimeError):  # stopped when the client went away
        uvloop.run(serve())


async def loop_client(sock: socket.socket, calls: int, poll: bool, in_flight: int) -> float:
    loop = asyncio.get_running_loop()
    _, caller = await loop.connect_accepted_socket(Caller, sock)
    if poll:
        spin_forever(loop)
    start = time.perf_counter()
    if in_flight == 1:
        for _ in range(calls):
            await caller.call()
    else:  # as bench_rpc.py's pipelined no-op: a semaphore, a done callback per call
        window = asyncio.Semaphore(in_flight)
        for _ in range(calls):
            await window.acquire()
            caller.call().add_done_callback(lambda _: window.release())
        for _ in range(in_flight):
            await window.acquire()
    return (time.perf_counter() - start) / calls


def one_round(kind: str, calls: int) -> float:
    """Seconds per call of ``kind``, in a fresh pair of processes."""
    ours, theirs = socket.socketpair()
    poll = kind == "uvloop + busy-poll"
    child = os.fork()
    if child == 0:
        ours.close()
        if kind == "blocking sockets":
            blocking_server(theirs)
        else:
            loop_server(theirs, poll)
        os._exit(0)
    theirs.close()
    try:
        if kind == "blocking sockets":
            return blocking_client(ours, calls)
        in_flight = 256 if kind == "uvloop, 256 in flight" else 1
        return uvloop.run(loop_client(ours, calls, poll, in_flight))
    finally:
        ours.close()
        os.waitpid(child, 0)


KINDS: dict[str, Callable[[int], float]] = {
    kind: (lambda calls, kind=kind: one_round(kind, calls))
    for kind in (
        "blocking sockets",
        "uvloop protocols",
        "uvloop + busy-poll",
        "uvloop, 256 in flight",
    )
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tries: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):  # alternating, so that a noisy moment hits every kind
        for kind, measure in KINDS.items():
            tries[kind].append(measure(args.calls) * 1e6)
    print(
        f"64-byte round trips between two processes, {args.rounds} rounds of {args.calls} "
        f"(µs per call), load {os.getloadavg()[0]:.2f}"
    )
    for kind, us in tries.items():
        each = " ".join(f"{u:.1f}" for u in us)
        print(f"  {kind:24s} median {statistics.median(us):6.1f}   [{each}]")


if __name__ == "__main__":
    main()
