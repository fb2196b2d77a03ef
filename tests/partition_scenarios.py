"""A network partition mid-job (see tests/integration/test_partition.py).

Rank 0 keeps ``STREAM`` calls to rank 1 in flight, cuts the network (the peer's end of
the veth pair down, so to rank 0 the peer just goes silent: no error, no reset), waits
for the calls to fail (``MODE_ENV``: "busy", short calls keep requests going out
unacknowledged; "idle", long calls wait for their replies and nothing flows), keeps
calling for ``PARTITION_AFTER_LOSS`` seconds, heals the network, and calls until a
call goes through.  It reports every call (start, end,
outcome, relative to the cut) and the moments of the cut, the loss, the healing and
the first success, and whom it counted dead during and after.  Rank 1 serves until
rank 0 releases it.  Both then shut down.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import asyncrpc
from asyncrpc.errors import AsyncRPCError
from tests.netns import join_from_namespace
from tests.scenarios import Config

CUT_ENV = "ASYNCRPC_TEST_CUT"  # "namespace veth": the end of the pair to take down
MODE_ENV = "ASYNCRPC_TEST_PARTITION"  # "busy" or "idle"
SILENCE = float(os.environ.get("ASYNCRPC_TEST_SILENCE", "3"))  # silent_peer_timeout, s
STREAM = 4  # calls kept in flight
WORK = 0.02  # seconds each call takes on rank 1
LONG_WORK = 25.0  # seconds each call takes on rank 1 at the cut, when idle
PACE = 0.05  # seconds between a failed call and the next (no busy loop while it fails)
PARTITION_AFTER_LOSS = 3.0  # seconds the partition lasts once the loss was seen
DEADLINE = 20.0  # seconds for each step to happen (the loss, the first success after)
SHUTDOWN_TIMEOUT = 20.0
_released: asyncio.Event | None = None


async def work(delay: float) -> float:
    await asyncio.sleep(delay)
    return delay


async def release() -> None:
    """Rank 0 is done: rank 1 may shut down."""
    assert _released is not None
    _released.set()


@dataclass
class Call:
    start: float
    end: float = 0.0
    error: str | None = None  # "TypeName: message"; None: it succeeded
    details: dict[str, Any] | None = None


class Stream:
    """``STREAM`` callers, each calling ``peer`` again as soon as its call ends."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.calls: list[Call] = []
        self.running = True
        self.work = WORK  # seconds each new call takes on rank 1

    async def caller(self) -> None:
        while self.running:
            call = Call(time.monotonic())
            self.calls.append(call)
            try:
                await asyncrpc.rpc_async(self.peer, work, (self.work,))
            except Exception as exc:
                call.error = f"{type(exc).__name__}: {exc}"
                call.details = exc.details if isinstance(exc, AsyncRPCError) else None
            call.end = time.monotonic()
            if call.error is not None:
                await asyncio.sleep(PACE)

    async def started(self, condition: Any) -> None:
        """Poll until ``condition(calls)`` holds."""
        deadline = time.monotonic() + DEADLINE
        while not condition(self.calls):
            assert time.monotonic() < deadline, f"calls not started within {DEADLINE}s"
            await asyncio.sleep(0.01)

    async def until(self, condition: Any, what: str) -> float:
        """Poll until ``condition(call)`` holds for an ended call; the first such end."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            ends = [c.end for c in self.calls if c.end and condition(c)]
            if ends:
                return min(ends)
            await asyncio.sleep(0.01)
        raise AssertionError(f"{what}: not within {DEADLINE}s")


async def link(state: str) -> None:
    """``ip link set`` the cut's veth end ``state`` (up or down), in its namespace."""
    namespace, veth = os.environ[CUT_ENV].split()
    command = ["ip", "-n", namespace, "link", "set", veth, state]
    proc = await asyncio.create_subprocess_exec(*command)
    assert await asyncio.wait_for(proc.wait(), 10) == 0, command


async def partition(cfg: Config) -> dict[str, Any]:
    global _released
    _released = asyncio.Event()
    await join_from_namespace(cfg, rpc_timeout=30, silent_peer_timeout=SILENCE)
    seen = await (_cut_and_heal() if cfg.rank == 0 else _serve())
    began = time.monotonic()
    await asyncrpc.shutdown(timeout=SHUTDOWN_TIMEOUT)
    seen["shutdown_s"] = time.monotonic() - began
    return seen


async def _serve() -> dict[str, Any]:
    assert _released is not None
    await asyncio.wait_for(_released.wait(), 60)
    return {"dead_peers": asyncrpc.get_debug_info()["dead_peers"]}


async def _cut_and_heal() -> dict[str, Any]:
    stream = Stream("w1")
    callers = [asyncio.create_task(stream.caller()) for _ in range(STREAM)]
    await stream.until(lambda c: c.error is None, "a first call")
    if os.environ[MODE_ENV] == "idle":  # every caller in a long call: nothing flows
        stream.work = LONG_WORK
        started = time.monotonic()
        await stream.started(lambda calls: sum(c.start > started for c in calls) == STREAM)
    cut = time.monotonic()
    await link("down")
    cut_done = time.monotonic()
    lost = await stream.until(lambda c: c.error is not None, "a call failing")
    stream.work = WORK
    await asyncio.sleep(PARTITION_AFTER_LOSS)  # the partition goes on: calls keep failing
    dead_during = asyncrpc.get_debug_info()["dead_peers"]
    heal = time.monotonic()
    await link("up")
    back = await stream.until(lambda c: c.error is None and c.start >= heal, "a call after")
    stream.running = False
    await asyncio.gather(*callers)
    await asyncrpc.rpc_async("w1", release)
    return {
        "calls": [
            {**vars(c), "start": c.start - cut, "end": c.end - cut}
            for c in stream.calls
            if c.end > cut - 1  # the last second before the cut, and everything after
        ],
        "cut_done": cut_done - cut,
        "lost": lost - cut,
        "heal": heal - cut,
        "back": back - cut,
        "links": asyncrpc.get_debug_info()["links"],
        "dead_during": dead_during,
        "dead_peers": asyncrpc.get_debug_info()["dead_peers"],
    }
