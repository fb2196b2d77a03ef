"""Same-host shared memory between agents on one loop: copies run off the loop and keep
each link's order, the budget sends the rest through the socket (whatever the receiver
keeps alive), and a receiver lets go of segments its sender closed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import pytest
import torch

from asyncrpc.agent import AgentOptions, RpcAgent, on_loop
from asyncrpc.errors import PeerLostError
from asyncrpc.transport import shm
from asyncrpc.transport.housekeeping import Copiers
from asyncrpc.wire import Kind
from tests.in_process import joined_agents

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"),
        reason="shared-memory segments need Linux memfd and /proc",
    ),
]
MiB = 1 << 20
OPTIONS = AgentOptions(transports=("unix",), rpc_timeout=20)
arrivals: list[int] = []
kept: list[torch.Tensor] = []


@on_loop
def arrive(i: int, x: torch.Tensor | None) -> int:
    """Runs on the callee's loop as its request arrives: records the arrival order."""
    arrivals.append(i)
    return 0 if x is None else x.numel()


def digest(x: torch.Tensor) -> str:
    return hashlib.blake2b(memoryview(x.numpy()).cast("B")).hexdigest()


def keep(x: torch.Tensor) -> str:
    """A receiver that never lets go of what it was sent."""
    kept.append(x)
    return digest(x)


def tensor(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=generator)


def echo(x: torch.Tensor) -> torch.Tensor:
    """A plain function (run in the callee's pool) that sends its argument back."""
    return x


@on_loop
def echo_on_arrival(x: torch.Tensor) -> torch.Tensor:
    """Sends its argument back as its request arrives: the reply takes its segment
    before the callee reads any frame that came after the request."""
    return x


async def negate(x: torch.Tensor) -> torch.Tensor:
    """A coroutine (run on the callee's loop) answering with a new tensor."""
    return -x


@pytest.fixture(autouse=True)
def fresh() -> None:
    arrivals.clear()
    kept.clear()


@pytest.fixture
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RpcAgent, RpcAgent]]:
    options = getattr(request, "param", OPTIONS)
    async with joined_agents("ab", options) as agents:
        yield agents[0], agents[1]


def shared(agent: RpcAgent) -> dict[str, int]:
    info: dict[str, int] = agent.debug_info()["shared_memory"]
    return info


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until ``condition()``: messages still travel between the agents."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


async def test_copies_run_off_the_loop_unless_small_and_warm_and_nothing_overtakes(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    copied_on: list[str] = []
    fill = shm.Segment.fill

    def recording_fill(
        segment: shm.Segment, data: memoryview, helpers: Copiers | None = None
    ) -> None:
        copied_on.append(threading.current_thread().name)
        fill(segment, data, helpers)

    monkeypatch.setattr(shm.Segment, "fill", recording_fill)
    big, medium = torch.ones(8 * MiB), torch.ones(MiB)  # 32 MiB and 4 MiB
    calls = [
        a.rpc_async("b", arrive, args=(0, big)),
        a.rpc_async("b", arrive, args=(1, None)),
        a.rpc_async("b", arrive, args=(2, medium)),
        a.rpc_async("b", arrive, args=(3, None)),
    ]
    assert await asyncio.gather(*calls) == [8 * MiB, 0, MiB, 0]
    assert arrivals == [0, 1, 2, 3]
    assert len(copied_on) == 2  # new segments: both copies in copier threads
    assert all(name.startswith("asyncrpc-shm-copy") for name in copied_on)
    await eventually(lambda: shared(a)["segments_in_use"] == 0, "both segments released")

    # Again, into the same (warm) segments: 4 MiB is copied on the loop at once, yet
    # its message still waits behind the 32 MiB one.
    arrivals.clear()
    copied_on.clear()
    calls = [
        a.rpc_async("b", arrive, args=(0, big)),
        a.rpc_async("b", arrive, args=(1, medium)),
        a.rpc_async("b", arrive, args=(2, None)),
    ]
    assert await asyncio.gather(*calls) == [8 * MiB, MiB, 0]
    assert arrivals == [0, 1, 2]
    assert sorted(name.startswith("asyncrpc-shm-copy") for name in copied_on) == [False, True]
    assert threading.current_thread().name in copied_on
    stats = shared(a)
    assert stats["fallbacks"] == 0 and stats["segments_in_use"] + stats["segments_idle"] == 2


@pytest.mark.parametrize("func", [echo, negate], ids=["plain-echo", "coroutine-negate"])
@pytest.mark.parametrize("nbytes", [2 * MiB, 32 * MiB], ids=["copied-on-the-loop", "copier"])
async def test_a_callers_segment_is_free_again_when_the_reply_arrives(
    pair: tuple[RpcAgent, RpcAgent], nbytes: int, func: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """The callee lets go of a request's segment before its reply leaves, so a caller
    calling again at once reuses it (its next call used to beat the release and pay
    for a new, cold segment)."""
    a, _ = pair
    x = tensor(nbytes, 30)
    for _ in range(4):
        y = await a.rpc_async("b", func, args=(x,))
        assert shared(a)["segments_in_use"] == 0
        assert torch.equal(y, x if func is echo else -x)
    assert shared(a)["peak_bytes"] == nbytes


@pytest.mark.parametrize("func", [echo, echo_on_arrival], ids=["in-pool", "on-arrival"])
@pytest.mark.parametrize("nbytes", [2 * MiB, 32 * MiB], ids=["copied-on-the-loop", "copier"])
async def test_a_result_dropped_before_the_next_call_leaves_the_callee_one_segment(
    pair: tuple[RpcAgent, RpcAgent], nbytes: int, func: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """``y = await rpc_async(...)``, ``del y``, call again: ``y`` dies only once the step
    that sent the next call ends (asyncio's callback holds the future that carried it),
    and its release still leads that call, so the callee reuses its segment for every
    reply (a call copied on the loop used to leave first, and the callee's reply took a
    new segment, whose pages it faulted in)."""
    a, b = pair
    x = tensor(nbytes, 32)
    for _ in range(4):
        y = await a.rpc_async("b", func, args=(x,))
        assert torch.equal(y, x)
        del y
    stats = shared(b)
    assert stats["fallbacks"] == 0
    assert stats["peak_bytes"] == nbytes


@pytest.mark.parametrize("nbytes", [2 * MiB, 32 * MiB], ids=["copied-on-the-loop", "copier"])
async def test_keeping_the_previous_result_alive_costs_the_callee_two_segments(
    pair: tuple[RpcAgent, RpcAgent], nbytes: int
) -> None:
    """A caller that keeps its previous result while the next call runs, as training
    loops do: dropping it releases the callee's segment ahead of the next request, even
    one still waiting for its copy (the release waited behind it, and the callee's
    reply took a third segment, or the socket once the budget was spent)."""
    a, b = pair
    x = tensor(nbytes, 31)
    previous = None
    for _ in range(6):
        result = await a.rpc_async("b", echo, args=(x,))
        assert previous is None or torch.equal(previous, x)  # alive until here
        previous = result
    stats = shared(b)
    assert stats["fallbacks"] == 0
    assert stats["peak_bytes"] == 2 * nbytes


@pytest.mark.parametrize(
    "pair", [replace(OPTIONS, shared_memory_budget=8 * MiB)], indirect=True, ids=["8MiB"]
)
async def test_beyond_the_budget_buffers_go_through_the_socket(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    sent = [tensor(4 * MiB, i) for i in range(6)]
    answers = await asyncio.gather(*(a.rpc_async("b", digest, args=(x,)) for x in sent))
    assert answers == [digest(x) for x in sent]
    stats = shared(a)
    assert stats["fallbacks"] == 4  # two 4 MiB segments fill the budget
    assert stats["peak_bytes"] <= 8 * MiB


@pytest.mark.parametrize(
    "pair", [replace(OPTIONS, shared_memory_budget=8 * MiB)], indirect=True, ids=["8MiB"]
)
async def test_a_receiver_keeping_every_tensor_does_not_stall_its_sender(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    for i in range(6):  # one after another: nothing is ever released
        x = tensor(4 * MiB, 10 + i)
        assert await a.rpc_async("b", keep, args=(x,)) == digest(x)
    assert [digest(x) for x in kept] == [digest(tensor(4 * MiB, 10 + i)) for i in range(6)]
    stats = shared(a)
    assert stats["segments_in_use"] == 2 and stats["bytes_in_use"] == 8 * MiB
    assert stats["fallbacks"] == 4


async def test_a_failed_copy_falls_back_to_the_socket(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair

    def no_memory(segment: shm.Segment, data: memoryview) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(shm.Segment, "fill", no_memory)
    x = tensor(4 * MiB, 20)
    assert await a.rpc_async("b", digest, args=(x,)) == digest(x)
    assert await a.rpc_async("b", arrive, args=(1, None)) == 0  # the link still works
    stats = shared(a)
    assert stats["fallbacks"] == 1 and stats["segments_in_use"] == 0


@pytest.mark.parametrize(
    "pair", [replace(OPTIONS, shared_memory_idle=0)], indirect=True, ids=["no-idle"]
)
async def test_the_receiver_unmaps_segments_its_sender_closed(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    for size in (2, 3, 4):  # each one too large to reuse the last: three segments
        x = tensor(size * MiB, size)
        assert await a.rpc_async("b", digest, args=(x,)) == digest(x)
    await eventually(
        lambda: shared(a)["segments_in_use"] == 0 and shared(a)["segments_idle"] == 1,
        "the receiver releases all, and after their grace all idle segments but the last "
        "released one close (the idle cap is 0)",
    )
    await eventually(
        lambda: shared(b)["mapped_bytes"] == shared(a)["bytes_idle"],
        "the receiver drops the mappings of the two closed segments",
    )


async def test_nothing_is_lent_to_a_link_that_is_gone(pair: tuple[RpcAgent, RpcAgent]) -> None:
    """A reply encoded in a pool thread while its link drops, or a send on a dropped
    link: segments lent then would count against the budget forever."""
    a, _ = pair
    link = a._links.get("b") or await a._connect("b")
    link.abort(PeerLostError("dropped by the test"))
    big = memoryview(bytes(2 * MiB))
    parts = await asyncio.to_thread(link.encode, Kind.RESPONSE, {"i": 1}, b"", [big])
    assert parts  # encoded all the same (the caller drops them)
    link.send(Kind.RESPONSE, {"i": 2}, b"", [big])
    stats = shared(a)
    assert stats["segments_in_use"] == 0 and stats["bytes_in_use"] == 0


@pytest.mark.parametrize(
    "sides", [(False, False), (False, True), (True, False)], ids=["neither", "b", "a"]
)
async def test_a_worker_without_shared_memory_sends_large_tensors_through_the_socket(
    sides: tuple[bool, bool],
) -> None:
    """``shared_memory=False`` on either side or both: large requests and replies arrive
    whole, plain and coroutine callees alike; a worker without a pool sends through the
    socket and still maps the segments a peer lends it."""
    options = [replace(OPTIONS, shared_memory=on) for on in sides]
    async with joined_agents("ab", options) as (a, b):
        x = tensor(4 * MiB, seed=3)
        assert torch.equal(await a.rpc_async("b", echo, args=(x,)), x)
        assert torch.equal(await a.rpc_async("b", negate, args=(x,)), -x)
        assert torch.equal(await b.rpc_async("a", echo, args=(x,)), x)
        for agent, on in zip((a, b), sides, strict=True):
            assert (agent.debug_info()["shared_memory"] is not None) is on
