"""RRefs between three agents on one event loop, over real loopback sockets.

Fast tests of the API's behaviour; the multi-process jobs are in test_rref_processes.py.
``remote()`` and ``RRef(value)`` act for the *default* agent, so each test says
which worker acts with :func:`acting_as`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import operator
import pickle
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from asyncrpc import RemoteError, RPCTimeoutError, RRef, RRefError, SerializationError, remote
from asyncrpc.agent import AgentOptions, RpcAgent, async_execution, set_default_agent
from asyncrpc.rref import context_for
from asyncrpc.wire import Kind
from tests.in_process import joined_agents, watch_sends

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def trio() -> AsyncIterator[tuple[RpcAgent, RpcAgent, RpcAgent]]:
    async with joined_agents("abc", AgentOptions(transports=("unix",), rpc_timeout=10)) as agents:
        set_default_agent(agents[0])
        yield agents[0], agents[1], agents[2]
        set_default_agent(None)


@contextlib.contextmanager
def acting_as(agent: RpcAgent) -> Iterator[None]:
    set_default_agent(agent)
    try:
        yield
    finally:
        set_default_agent(None)


async def settled(agents: tuple[RpcAgent, ...]) -> list[dict[str, int]]:
    """Count dropped handles and wait until no RRef message is in flight anywhere (no
    fork request unanswered, no notice unhandled) and the counts hold still for a
    round: a handle can outlive its ``del`` by a loop turn or two (a callback still
    refers to it), and handling a message may send another."""
    contexts = [context_for(agent) for agent in agents]
    before = None
    while True:
        gc.collect()
        for context in contexts:
            context.count_dropped()
        await asyncio.gather(*(agent.notices_delivered() for agent in agents))
        flying = [f for context in contexts for f in context._in_flight]
        await asyncio.gather(*flying, return_exceptions=True)
        counts = [{k: v for k, v in a.debug_info().items() if "rrefs" in k} for a in agents]
        if not flying and counts == before:
            return counts
        before = counts


ZERO = {"owner_rrefs": 0, "user_rrefs": 0}


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    async def add_later(self, k: int) -> int:
        await asyncio.sleep(0)
        return self.add(k)

    @async_execution
    def add_when_told(self, k: int, told: Any) -> asyncio.Future[int]:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.set_result(self.add(k))
        return future

    def fail(self) -> None:
        raise KeyError("no such key")


class Broken:
    def __init__(self) -> None:
        raise ValueError("cannot build")


def slow_value() -> int:
    import time

    time.sleep(0.5)
    return 1


def owner_of(rref: RRef[Any]) -> str:
    return rref.owner_name()


def echo(x: Any) -> Any:
    return x


def value_on_owner(rref: RRef[Counter]) -> int:
    return rref.local_value().n


async def test_remote_to_here_and_proxies(trio: tuple[RpcAgent, RpcAgent, RpcAgent]) -> None:
    rref = remote("b", Counter, (5,))
    assert not rref.is_owner() and rref.owner().name == "b" and rref.owner_name() == "b"
    assert (await rref.to_here()).n == 5
    assert rref.confirmed_by_owner()  # b confirmed it before it replied with the value
    assert await rref.rpc_async().add(1) == 6
    assert await rref.rpc_async().add_later(1) == 7
    assert await rref.rpc_async().add_when_told(1, None) == 8
    added = rref.remote().add(2)
    assert await added.to_here() == 10 and added.owner_name() == "b"
    in_thread = await asyncio.to_thread(lambda r=rref: r.rpc_sync().add(0))
    assert in_thread == 10
    assert await trio[0].rpc_async("b", value_on_owner, (rref,)) == 10
    del rref, added
    assert await settled(trio) == [ZERO] * 3


def served_calls(agent: RpcAgent) -> dict[str, int]:
    """How many calls of each function ``agent`` has served."""
    served = agent.metrics.snapshot()["served"]
    return {f: sum(entry["outcomes"].values()) for f, entry in served.items()}


async def test_a_dropped_rref_costs_its_owner_a_notice_not_a_call(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
) -> None:
    """``remote()``, ``to_here()``, then the handle dies: the owner serves the creation
    and the fetch, and learns of the deletion from a notice (no reply to send)."""
    _, b, _ = trio
    before = served_calls(b)
    rref = remote("b", operator.add, (1, 2))
    assert await rref.to_here() == 3
    del rref
    assert await settled(trio) == [ZERO] * 3
    after = served_calls(b)
    new = {f: n - before.get(f, 0) for f, n in after.items() if n != before.get(f, 0)}
    del new["asyncrpc.agent.notices.delivered"]  # settled()'s own wait for the notice
    assert sorted(new) == ["RRef.to_here", "remote(_operator.add)"], new
    assert all(n == 1 for n in new.values()), new


async def test_the_deletion_of_a_dropped_rref_rides_on_the_next_remote(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
) -> None:
    """A loop that makes and drops RRefs: the owner confirms each before it sends its
    value, so when the handle dies its deletion can go at once, and it rides in the
    header of the next ``remote()``'s request, not in a frame of its own."""
    a = trio[0]
    for i in range(3):
        assert await remote("b", operator.add, (i, 1)).to_here() == i + 1
    await settled(trio)
    sent = watch_sends(a, "b")
    for i in range(3):
        assert await remote("b", operator.add, (i, 1)).to_here() == i + 1
    kinds = sent.kinds
    assert kinds == [Kind.REQUEST] * 6, kinds  # no NOTICE frame
    deletions = [meta.get("n") for meta in sent.metas if meta.get("f", "").startswith("remote(")]
    assert deletions[0] is None and all(d and d[0][0] == "rref.fork_deleted" for d in deletions[1:])
    assert await settled(trio) == [ZERO] * 3


async def test_thousands_of_rrefs_dropped_at_once_are_all_freed_and_calls_go_on(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent], caplog: pytest.LogCaptureFixture
) -> None:
    """A list of 6,000 handles dropped in one go: their deletions are more notices than
    one frame's header holds.  They travel in as many frames as they need, the next call
    (which would carry them) goes through, and the owner frees every value."""
    a = trio[0]
    rrefs = [remote("b", operator.add, (i, 1)) for i in range(6000)]
    assert [await r.to_here() for r in rrefs[:3]] == [1, 2, 3]
    await asyncio.gather(*(r.to_here() for r in rrefs))
    assert (await settled(trio))[1] == {"owner_rrefs": 6000, "user_rrefs": 0}
    del rrefs
    gc.collect()
    context_for(a).count_dropped()
    assert await a.rpc_async("b", operator.add, (2, 3)) == 5  # carrying what fits
    assert await settled(trio) == [ZERO] * 3
    assert "dropped" not in caplog.text


@pytest.mark.parametrize(
    "args",
    [(), (1, 2, 3), ("0", 1, 2, 3), (0, 1, 2, None), ([0, 1], [2, 3]), (0, 1, 2, 3, 4)],
    ids=repr,
)
@pytest.mark.parametrize("key", ["rref.fork_deleted", "rref.child_accepted"])
async def test_a_malformed_rref_notice_is_logged_and_changes_nothing(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
    key: str,
    args: tuple[Any, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = trio[0]
    rref = remote("b", Counter, (5,))
    assert (await rref.to_here()).n == 5
    a.notify("b", key, *args)
    await a.notices_delivered()
    assert "malformed RRef notice from worker 0" in caplog.text
    assert await rref.rpc_async().add(1) == 6  # b keeps serving, the RRef is intact
    del rref
    assert await settled(trio) == [ZERO] * 3


async def test_errors_surface_on_first_use(trio: tuple[RpcAgent, RpcAgent, RpcAgent]) -> None:
    broken = remote("b", Broken)
    with pytest.raises(ValueError, match="cannot build") as caught:
        await broken.to_here()
    assert caught.value.remote_worker == "b"  # type: ignore[attr-defined]
    assert 'raise ValueError("cannot build")' in caught.value.remote_traceback  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="cannot build"):
        await broken.rpc_async().anything()
    counter = remote("b", Counter)
    with pytest.raises(KeyError, match="no such key"):
        await counter.rpc_async().fail()
    with pytest.raises(AttributeError, match="missing"):
        await counter.rpc_async().missing()
    slow = remote("b", slow_value, timeout=0.1)
    with pytest.raises(RPCTimeoutError, match="'b'"):
        await slow.to_here()
    del broken, counter, slow, caught  # (the traceback refers to the handle too)
    assert await settled(trio) == [ZERO] * 3


async def test_local_value_only_on_owner(trio: tuple[RpcAgent, RpcAgent, RpcAgent]) -> None:
    local = RRef(torch.arange(3))
    assert local.is_owner() and local.confirmed_by_owner()
    assert torch.equal(local.local_value(), torch.arange(3))
    assert torch.equal(await local.to_here(), torch.arange(3))
    remote_one = remote("b", Counter)
    with pytest.raises(RRefError, match="not its owner"):
        remote_one.local_value()
    await remote_one.to_here()


async def test_handles_travel_everywhere_and_are_released(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
) -> None:
    a = trio[0]
    counter = remote("b", Counter, (1,))
    mine = RRef(torch.ones(2))
    # owner->user, user->user, user->owner, nested, in arguments and in results
    assert await a.rpc_async("c", owner_of, (counter,)) == "b"
    back = await a.rpc_async("c", echo, ({"nested": [counter, (mine,)]},))
    assert back["nested"][0].owner_name() == "b" and back["nested"][1][0].is_owner()
    via_owner = await a.rpc_async("b", echo, (counter,))
    assert via_owner.owner_name() == "b" and not via_owner.is_owner()
    assert await a.rpc_async("c", echo, (mine,)) is not None
    counts = await settled(trio)
    assert counts[1]["owner_rrefs"] == 1 and counts[0]["user_rrefs"] == 1
    del counter, mine, back, via_owner
    assert await settled(trio) == [ZERO] * 3


async def test_remote_to_self_and_owner_proxies(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
) -> None:
    rref = remote("a", Counter, (3,))
    assert rref.is_owner()
    assert (await rref.to_here()).n == 3
    assert await rref.rpc_async().add(1) == 4
    assert await rref.remote().add(1).to_here() == 5
    assert await asyncio.to_thread(lambda: rref.rpc_sync().add(1)) == 6
    with acting_as(trio[2]):
        from_c = remote("c", Counter)
    assert from_c.owner_name() == "c"


async def test_rref_only_pickles_into_calls(trio: tuple[RpcAgent, RpcAgent, RpcAgent]) -> None:
    rref = RRef(1)
    with pytest.raises(SerializationError, match="asyncrpc calls"):
        pickle.dumps(rref)
    assert copy.deepcopy([rref])[0] is rref


async def test_dead_owner_fails_uses_at_once(trio: tuple[RpcAgent, RpcAgent, RpcAgent]) -> None:
    a, _, c = trio
    rref = remote("c", Counter)
    await rref.to_here()
    await c.shutdown(graceful=False)
    with pytest.raises(ConnectionError, match="'c'"):
        await rref.to_here()
    with pytest.raises(ConnectionError, match="'c'"):
        await rref.rpc_async().add(1)
    assert context_for(a).debug_info()["user_rrefs"] == 0  # forgotten with its owner
    with pytest.raises(ConnectionError, match="owner 'c'"):
        await a.rpc_async("b", echo, (rref,))  # the handle cannot travel any more


async def never_made() -> int:
    await asyncio.get_running_loop().create_future()  # cancelled at shutdown
    return 0


async def test_owner_to_here_timeout_is_an_rpc_timeout(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
) -> None:
    rref = remote("a", never_made)
    assert rref.is_owner()
    with pytest.raises(RPCTimeoutError, match="not made within"):
        await rref.to_here(timeout=0.05)


async def test_remote_error_type_survives(trio: tuple[RpcAgent, RpcAgent, RpcAgent]) -> None:
    rref = remote("b", RemoteError, ("x",))  # a value that is itself an exception type
    assert isinstance(await rref.to_here(), RemoteError)


async def test_remote_to_a_dead_worker_fails_once_and_logs_nothing(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent], caplog: pytest.LogCaptureFixture
) -> None:
    a, _, c = trio
    await c.shutdown(graceful=False)
    with acting_as(a):
        rref = remote("c", torch.add, args=(torch.ones(2), 1))
        with pytest.raises(ConnectionError, match="'c'"):
            await rref.to_here()
    del rref
    await settled(trio)  # every message of the RRef layer has ended
    gc.collect()
    await asyncio.sleep(0)  # (the loop logs unretrieved errors from a callback)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


class Gate:
    opened: asyncio.Event


async def made_later(value: int) -> int:
    await Gate.opened.wait()
    return value


def read_local_value(rref: RRef[int]) -> int:
    return rref.local_value() + 1


async def read_local_value_on_loop(rref: RRef[int]) -> int:
    return rref.local_value() + 1


@pytest.mark.parametrize("reader", [read_local_value, read_local_value_on_loop])
async def test_a_call_given_its_owners_rref_starts_once_the_value_is_made(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent], reader: Any
) -> None:
    """As in torch (the RL and parameter-server tutorials rely on it): a call right after
    remote(), to the owner, with the RRef, sees the value; so does one from a worker the
    RRef was passed to."""
    a, _, _ = trio
    Gate.opened = asyncio.Event()
    with acting_as(a):
        rref = remote("b", made_later, args=(41,))
        direct = a.rpc_async("b", reader, args=(rref,))
        forwarded = a.rpc_async("c", forward_to_owner, args=(rref, reader))
    await asyncio.sleep(0.05)
    assert not direct.done() and not forwarded.done()  # nothing is made yet: they wait
    Gate.opened.set()
    assert await asyncio.wait_for(asyncio.gather(direct, forwarded), 10) == [42, 42]


async def forward_to_owner(rref: RRef[int], reader: Any) -> int:
    from asyncrpc.agent import current_agent

    agent = current_agent()  # (c's, in this call)
    assert agent is not None
    return await agent.rpc_async("b", reader, args=(rref,))  # type: ignore[no-any-return]


async def test_a_call_given_an_rref_whose_making_failed_raises_that_error(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
) -> None:
    a, _, _ = trio
    with acting_as(a):
        rref = remote("b", operator.truediv, args=(1, 0))
        with pytest.raises(ZeroDivisionError):
            await a.rpc_async("b", read_local_value, args=(rref,))


async def value_made_late(x: int) -> int:
    await asyncio.sleep(0.05)  # the RRef's value is not made when the next request arrives
    return x


def plus_one(rref: RRef[int]) -> int:
    return rref.local_value() + 1


async def test_to_here_right_after_a_remote_that_waits_for_its_rref_arguments(
    trio: tuple[RpcAgent, RpcAgent, RpcAgent],
) -> None:
    slow = remote("b", value_made_late, (41,))
    later = remote("b", plus_one, (slow,))  # starts on b once `slow` is made there
    assert await later.to_here() == 42  # b knows `later` although its call is held back
    assert await later.rpc_async().__add__(1) == 43
    del slow, later
    assert await settled(trio) == [ZERO] * 3
