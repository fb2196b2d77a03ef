"""Messages that wait for copies still running (CUDA tensors staged through host memory),
with stand-in events, so it runs without a GPU: such a message leaves once its copies
are done, the loop goes on meanwhile, and nothing overtakes it on its way to a peer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from asyncrpc.agent import AgentOptions, RpcAgent
from asyncrpc.agent.transfer import current_transfer
from asyncrpc.serde import register_reducer
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(30)


class Copy:
    """Stands for a CUDA event: query() and a blocking synchronize()."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(20), "the copy never finished"


class Staged:
    """A value whose serialisation starts a copy (``copy``) the message must wait for."""

    copy: Copy | None = None

    def __init__(self, label: str) -> None:
        self.label = label


def _rebuild(label: str) -> str:
    return label


def _reduce(value: Staged) -> Any:
    transfer = current_transfer()
    assert transfer is not None and value.copy is not None
    transfer.staged.append(value.copy)
    return _rebuild, (value.label,)


register_reducer(Staged, _reduce)

arrivals: list[str] = []


def arrived(label: str) -> str:
    arrivals.append(label)
    return label


async def staged_reply(label: str) -> Staged:
    return Staged(label)


def staged_reply_in_pool(label: str) -> Staged:
    return Staged(label)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RpcAgent, RpcAgent]]:
    arrivals.clear()
    async with joined_agents("ab", AgentOptions(transports=("unix",), rpc_timeout=20)) as agents:
        yield agents[0], agents[1]


async def test_a_request_leaves_when_its_copy_is_done_and_nothing_overtakes_it(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    assert await a.rpc_async("b", arrived, ("warm",)) == "warm"  # the link is up
    Staged.copy = copy = Copy()
    first = a.rpc_async("b", arrived, (Staged("first"),))
    second = a.rpc_async("b", arrived, ("second",))  # plain, made after
    for _ in range(20):  # the loop keeps turning; neither call may arrive yet
        await asyncio.sleep(0)
    await asyncio.wait([first, second], timeout=0.05)
    assert not first.done() and not second.done()
    assert arrivals == ["warm"]
    copy.done.set()
    assert await asyncio.gather(first, second) == ["first", "second"]
    assert arrivals == ["warm", "first", "second"]


@pytest.mark.parametrize("function", [staged_reply, staged_reply_in_pool])
async def test_a_reply_leaves_when_its_copy_is_done(
    pair: tuple[RpcAgent, RpcAgent], function: Any
) -> None:
    a, _ = pair
    Staged.copy = copy = Copy()
    reply = a.rpc_async("b", function, ("result",))
    await asyncio.wait([reply], timeout=0.1)
    assert not reply.done()
    assert await a.rpc_async("b", arrived, ("meanwhile",)) == "meanwhile"  # b still serves
    copy.done.set()
    assert await reply == "result"


async def test_a_copy_already_done_sends_at_once(pair: tuple[RpcAgent, RpcAgent]) -> None:
    a, _ = pair
    Staged.copy = copy = Copy()
    copy.done.set()
    assert await a.rpc_async("b", arrived, (Staged("quick"),)) == "quick"
