"""Replicas over real loopback links: least outstanding first, failover from a lost
worker without losing calls that never left, and a fast failure when none is live."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from asyncrpc import OverloadedError, PeerLostError
from asyncrpc.agent import AgentOptions, RpcAgent, current_agent
from asyncrpc.functions import batch
from asyncrpc.serving import Replicas
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(30)


class Gate:
    opened: asyncio.Event
    entered: asyncio.Event


@pytest.fixture(autouse=True)
def gate() -> None:
    Gate.opened, Gate.entered = asyncio.Event(), asyncio.Event()


@pytest.fixture
async def trio() -> AsyncIterator[list[RpcAgent]]:
    options = AgentOptions(transports=("unix",), rpc_timeout=10, connect_timeout=2)
    async with joined_agents("abc", options) as agents:
        yield agents


async def where() -> str:
    agent = current_agent()
    assert agent is not None
    return agent.info.name


async def held() -> str:
    Gate.entered.set()
    await Gate.opened.wait()
    return await where()


async def test_calls_go_to_the_replica_with_the_fewest_outstanding(trio: list[RpcAgent]) -> None:
    replicas = Replicas(["b", "c"], agent=trio[0])
    slow = replicas.rpc_async(held)  # to b: ties go to the one picked longest ago
    await Gate.entered.wait()
    assert replicas.outstanding == {"b": 1, "c": 0}
    assert [await replicas.rpc_async(where) for _ in range(3)] == ["c", "c", "c"]
    Gate.opened.set()
    assert await slow == "b"
    spread = await asyncio.gather(*(replicas.rpc_async(where) for _ in range(4)))
    assert sorted(spread) == ["b", "b", "c", "c"]
    assert replicas.outstanding == {"b": 0, "c": 0}


async def test_a_call_that_never_left_fails_over_to_a_live_replica(trio: list[RpcAgent]) -> None:
    _, _, c = trio
    replicas = Replicas(["c", "b"], agent=trio[0])
    await c.shutdown(graceful=False)  # dead before anyone dialed it
    assert await asyncio.gather(*(replicas.rpc_async(where) for _ in range(4))) == ["b"] * 4
    assert replicas.live == ["b"]


async def test_a_call_lost_with_its_worker_after_it_left_fails(trio: list[RpcAgent]) -> None:
    _, _, c = trio
    replicas = Replicas(["c", "b"], agent=trio[0])
    in_flight = replicas.rpc_async(held)
    await Gate.entered.wait()  # running on c: it may have had effects
    await c.shutdown(graceful=False)
    with pytest.raises(PeerLostError, match="lost connection to worker 'c'"):
        await in_flight
    assert replicas.live == ["b"]


async def test_idempotent_replicas_retry_a_call_lost_after_it_left(trio: list[RpcAgent]) -> None:
    _, _, c = trio
    replicas = Replicas(["c", "b"], idempotent=True, agent=trio[0])
    in_flight = replicas.rpc_async(held)
    await Gate.entered.wait()
    await c.shutdown(graceful=False)
    Gate.opened.set()
    assert await in_flight == "b"
    assert replicas.outstanding == {"c": 0, "b": 0}


async def test_with_no_live_replica_a_call_fails_at_once(trio: list[RpcAgent]) -> None:
    _, b, c = trio
    await b.shutdown(graceful=False)
    await c.shutdown(graceful=False)
    replicas = Replicas(["b", "c"], retry_lost_after=60, agent=trio[0])
    with pytest.raises(PeerLostError):
        await replicas.rpc_async(where)
    assert replicas.live == []
    with pytest.raises(PeerLostError, match=r"no live replica .*lost \['b', 'c'\]"):
        await asyncio.wait_for(replicas.rpc_async(where), timeout=0.5)


async def test_a_lost_replica_is_tried_again_after_retry_lost_after(trio: list[RpcAgent]) -> None:
    replicas = Replicas(["b", "c"], retry_lost_after=0.0, agent=trio[0])
    replicas.mark_lost("b")  # as if a partition had cut it off; it serves again
    assert sorted(await asyncio.gather(*(replicas.rpc_async(where) for _ in range(2)))) == [
        "b",
        "c",
    ]


def test_replicas_need_distinct_workers() -> None:
    with pytest.raises(ValueError, match="distinct worker names"):
        Replicas(["b", "b"])
    with pytest.raises(ValueError, match="distinct worker names"):
        Replicas([])


@batch(max_size=10, max_wait=60.0, max_queue=1)
def limited(items: list[int]) -> list[str]:
    agent = current_agent()
    assert agent is not None
    return [agent.info.name for _ in items]


async def test_a_replica_whose_queue_is_full_sends_the_call_to_another(
    trio: list[RpcAgent],
) -> None:
    a, _, _ = trio
    filling = a.rpc_async("b", limited, (0,))  # b's queue is full now
    while not _waiting_on(trio[1]):
        await asyncio.sleep(0.005)
    replicas = Replicas(["b", "c"], agent=a)
    elsewhere = replicas.rpc_async(limited, (1,))  # b first (a tie), refused, then c
    while not _waiting_on(trio[2]):
        await asyncio.sleep(0.005)
    limited.configure(max_size=1)
    try:
        assert await elsewhere == "c" and await filling == "b"
    finally:
        limited.configure(max_size=10)


async def test_every_replica_refusing_fails_with_the_refusal(trio: list[RpcAgent]) -> None:
    a, _, _ = trio
    held_calls = [a.rpc_async(w, limited, (0,)) for w in ("b", "c")]
    while not (_waiting_on(trio[1]) and _waiting_on(trio[2])):
        await asyncio.sleep(0.005)
    with pytest.raises(OverloadedError, match="limited is overloaded"):
        await Replicas(["b", "c"], agent=a).rpc_async(limited, (1,))
    limited.configure(max_size=1)
    try:
        assert await asyncio.gather(*held_calls) == ["b", "c"]
    finally:
        limited.configure(max_size=10)


def _waiting_on(agent: RpcAgent) -> int:
    stats = agent.debug_info().get("batched_functions", {}).get(limited.rpc_name, {})
    return int(stats.get("waiting", 0))


async def test_a_worker_the_agent_lost_is_not_live_before_any_call_fails(
    trio: list[RpcAgent],
) -> None:
    a, _, c = trio
    replicas = Replicas(["b", "c"], agent=a, retry_lost_after=60)
    await a.rpc_async("c", where)  # a link to c exists
    await c.shutdown(graceful=False)
    while "c" not in a.lost_peers:
        await asyncio.sleep(0.005)
    assert replicas.live == ["b"]
    assert await asyncio.gather(*(replicas.rpc_async(where) for _ in range(3))) == ["b"] * 3
