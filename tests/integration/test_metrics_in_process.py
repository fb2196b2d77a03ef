"""A worker's metrics after a known sequence of calls: exact counts on both sides."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from asyncrpc import PeerLostError, RPCTimeoutError
from asyncrpc.agent import AgentOptions, RpcAgent
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(30)
MIB = 1 << 20


@pytest.fixture
async def trio() -> AsyncIterator[list[RpcAgent]]:
    options = AgentOptions(transports=("unix",), rpc_timeout=10)
    async with joined_agents("abc", options) as agents:
        yield agents


def add(x: int, y: int) -> int:
    return x + y


def fail() -> None:
    raise ValueError("no")


async def hang() -> None:
    await asyncio.Event().wait()


def echo(x: Any) -> Any:
    return x


def _name(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


async def _until(condition: Any) -> None:
    while not condition():  # bounded by the test's timeout
        await asyncio.sleep(0.005)


def _served(agent: RpcAgent, fn: Any) -> dict[str, int]:
    return dict(agent.metrics.snapshot()["served"].get(_name(fn), {}).get("outcomes", {}))


async def test_calls_made_and_served_are_counted_by_function_and_outcome(
    trio: list[RpcAgent],
) -> None:
    a, b, c = trio
    assert await asyncio.gather(*(a.rpc_async("b", add, (i, 1)) for i in range(3))) == [1, 2, 3]
    for _ in range(2):
        with pytest.raises(ValueError):
            await a.rpc_async("b", fail)
    with pytest.raises(RPCTimeoutError):
        await a.rpc_async("b", hang, timeout=0.05)
    await a.rpc_async("c", add, (0, 0))
    lost = a.rpc_async("c", hang)
    await _until(lambda: _served(c, add) == {"ok": 1} and c.debug_info()["running_incoming_calls"])
    await c.shutdown(graceful=False)
    with pytest.raises(PeerLostError):
        await lost

    made = a.debug_info()["calls"]["made"]
    assert made[_name(add)]["outcomes"] == {"ok": 4}
    assert made[_name(fail)]["outcomes"] == {"error": 2}
    assert made[_name(hang)]["outcomes"] == {"timeout": 1, "lost": 1}
    assert sum(made[_name(add)]["seconds"]["counts"]) == 4
    await _until(lambda: _served(b, hang) == {"cancelled": 1})  # its CANCEL reached b
    assert _served(b, add) == {"ok": 3}
    assert _served(b, fail) == {"error": 2}
    served = b.debug_info()["calls"]["served"][_name(add)]
    assert sum(served["seconds"]["counts"]) == sum(served["queued_seconds"]["counts"]) == 3
    assert served["queued_seconds"]["sum"] <= served["seconds"]["sum"]


async def test_bytes_are_counted_per_transport(trio: list[RpcAgent]) -> None:
    a, b, _ = trio
    small, large = torch.zeros(1000, dtype=torch.uint8), torch.zeros(2 * MIB, dtype=torch.uint8)
    await a.rpc_async("b", echo, (small,))
    before = a.debug_info()["bytes"]
    assert before["unix"]["sent"] >= 1000 and before["unix"]["received"] >= 1000
    assert "shared_memory" not in before  # below the threshold: inline
    await a.rpc_async("b", echo, (large,))
    after_a, after_b = a.debug_info()["bytes"], b.debug_info()["bytes"]
    assert after_a["shared_memory"] == {"sent": 2 * MIB, "received": 2 * MIB}  # there and back
    assert after_b["shared_memory"] == {"sent": 2 * MIB, "received": 2 * MIB}
    assert after_a["unix"]["sent"] - before["unix"]["sent"] < 64 * 1024  # not the tensor


async def test_the_thread_pool_and_lost_links_stay_in_the_figures(trio: list[RpcAgent]) -> None:
    a, b, _ = trio
    await a.rpc_async("b", add, (1, 2))
    # the reply leaves before its thread is counted free again
    await _until(lambda: b.debug_info()["thread_pool"]["busy"] == 0)
    assert b.debug_info()["thread_pool"] == {"threads": 1, "busy": 0, "queued": 0}
    sent = a.debug_info()["bytes"]["unix"]["sent"]
    await b.shutdown(graceful=False)
    await _until(lambda: not a.debug_info()["connected_peers"])
    assert a.debug_info()["bytes"]["unix"]["sent"] == sent  # kept after the link is gone


async def test_warm_receive_storage_is_bounded_and_reported() -> None:
    """Large tensors received through a socket land in pooled memory: a second one of
    the same size reuses the first's once it died, and what idles is reported."""
    options = AgentOptions(transports=("unix",), shared_memory=False, rpc_timeout=10)
    async with joined_agents("ab", options) as (a, b):
        for _ in range(2):  # each result dies before the next call
            assert (await a.rpc_async("b", echo, (torch.ones(2 * MIB, dtype=torch.uint8),))).all()
        storage = b.debug_info()["received_storage"]
        assert storage["created"] == 1 and storage["reused"] == 1
        assert 0 < storage["idle_bytes"] <= storage["max_idle_bytes"]
