"""One-way notices between agents on one loop: they ride on the next request to their
peer or leave on their own, keep their order with the frames around them, survive bad
input, and are all handled before a graceful shutdown completes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from asyncrpc.agent import AgentOptions, RpcAgent, on_loop, on_notice
from asyncrpc.errors import HandshakeError, PeerLostError, RPCTimeoutError
from asyncrpc.wire import Kind
from tests.in_process import joined_agents, watch_sends

pytestmark = pytest.mark.timeout(30)
seen: list[tuple[str, int, Any]] = []  # (agent, sender rank, value), in handling order


def _record(agent: RpcAgent, sender: int, value: Any) -> None:
    seen.append((agent.info.name, sender, value))


def _explode(agent: RpcAgent, sender: int) -> None:
    raise RuntimeError("this handler fails on purpose")


on_notice("test.record", _record)
on_notice("test.explode", _explode)


@on_loop
def record_call(value: Any) -> None:
    """A request's function, recorded where the notices are."""
    seen.append(("call", -1, value))


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RpcAgent, RpcAgent]]:
    seen.clear()
    async with joined_agents("ab", AgentOptions(transports=("unix",), rpc_timeout=10)) as agents:
        yield agents[0], agents[1]


async def test_a_notice_rides_on_the_next_request_in_order(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = pair
    await a.rpc_async("b", record_call, ("dial",))
    kinds = watch_sends(a, "b").kinds
    a.notify("b", "test.record", 1)
    a.notify("b", "test.record", 2)
    await a.rpc_async("b", record_call, ("after",))
    assert kinds == [Kind.REQUEST]  # no frame of their own
    assert seen[1:] == [("b", 0, 1), ("b", 0, 2), ("call", -1, "after")]
    assert a.debug_info()["queued_notices"] == 0


async def test_more_notices_than_a_header_holds_leave_ahead_of_the_request_in_order(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    """10,000 notices (~270 KB packed, a header holds 64 KiB): they leave in NOTICE
    frames just ahead of the next request, every one handled, in order, before it."""
    a, _ = pair
    await a.rpc_async("b", record_call, ("dial",))
    kinds = watch_sends(a, "b").kinds
    for i in range(10_000):
        a.notify("b", "test.record", f"notice {i:05}")
    await a.rpc_async("b", record_call, ("after",))
    assert kinds[-1] == Kind.REQUEST and set(kinds[:-1]) == {Kind.NOTICE}
    assert 6 <= len(kinds) - 1 <= 8  # ~48 KiB of notices a frame
    assert seen[1:] == [("b", 0, f"notice {i:05}") for i in range(10_000)] + [("call", -1, "after")]
    assert a.debug_info()["queued_notices"] == 0


async def test_a_notice_that_can_never_leave_is_dropped_alone(
    pair: tuple[RpcAgent, RpcAgent], caplog: pytest.LogCaptureFixture
) -> None:
    """A notice msgpack cannot pack, or larger than any frame's header, is logged and
    dropped; the notices around it and the call they would ride on go through."""
    a, _ = pair
    await a.rpc_async("b", record_call, ("dial",))
    a.notify("b", "test.record", "before")
    a.notify("b", "test.record", object())
    a.notify("b", "test.record", "x" * 70_000)
    a.notify("b", "test.record", "after")
    await a.rpc_async("b", record_call, ("call",))
    assert seen[1:] == [("b", 0, "before"), ("b", 0, "after"), ("call", -1, "call")]
    assert "for 'b' dropped: msgpack cannot pack it" in caplog.text
    assert "for 'b' dropped: 70018 bytes packed, more than a frame's 49152" in caplog.text


async def test_a_notice_alone_leaves_in_a_frame_of_its_own(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    a.notify("b", "test.record", "alone")  # no link yet: it dials
    await a.notices_delivered()
    assert seen == [("b", 0, "alone")]
    kinds = watch_sends(a, "b").kinds
    a.notify(1, "test.record", "again")  # by rank
    assert a.debug_info()["queued_notices"] == 1
    await a.notices_delivered()
    assert kinds[0] == Kind.NOTICE
    assert seen[-1] == ("b", 0, "again")
    b.notify("a", "test.record", "back")
    await b.notices_delivered()
    assert seen[-1] == ("a", 1, "back")


async def test_bad_notices_are_logged_and_the_worker_keeps_serving(
    pair: tuple[RpcAgent, RpcAgent], caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = pair
    await a.rpc_async("b", record_call, ("dial",))
    link = a._links["b"]
    with caplog.at_level(logging.WARNING, logger="asyncrpc.agent"):
        link.send(Kind.NOTICE, {"n": [["no.such.notice", 1], "not a list", []]})
        link.send(Kind.NOTICE, {"n": "not a list of notices"})
        a.notify("b", "test.explode")
        a.notify("b", "test.record", "too", "many")  # the handler takes one value
        a.notify("b", "test.record", "fine")
        await a.notices_delivered()
    assert seen[-1] == ("b", 0, "fine")
    assert await a.rpc_async("b", record_call, ("still serving",)) is None
    text = caplog.text
    assert "unknown notice" in text and "malformed notices" in text
    assert "fails on purpose" in text and "test.record" in text


async def test_graceful_shutdown_delivers_queued_notices_first(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    a, b = pair
    await a.rpc_async("b", record_call, ("dial",))
    a.notify("b", "test.record", "last words")
    await asyncio.gather(a.shutdown(), b.shutdown())
    assert seen[-1] == ("b", 0, "last words")


async def test_notices_queued_as_shutdown_starts_leave_before_its_announcement(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    """No loop turn between ``notify`` and ``shutdown``: the notice still leaves before
    a's SHUTDOWN announcement, in a NOTICE frame of its own, and b handles it."""
    a, b = pair
    await a.rpc_async("b", record_call, ("dial",))
    b_leaves = asyncio.ensure_future(b.shutdown())
    kinds = watch_sends(a, "b").kinds
    a.notify("b", "test.record", "last words")
    await a.shutdown()
    await b_leaves
    assert kinds[:2] == [Kind.NOTICE, Kind.SHUTDOWN]
    assert seen[-1] == ("b", 0, "last words")


async def test_notify_needs_a_running_agent_and_a_known_worker(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    from asyncrpc.errors import AgentStateError, UnknownWorkerError

    a, _ = pair
    with pytest.raises(UnknownWorkerError):
        a.notify("nobody", "test.record", 1)
    await a.shutdown(graceful=False)
    with pytest.raises(AgentStateError):
        a.notify("b", "test.record", 1)


async def test_a_lost_peer_has_nothing_left_to_handle(pair: tuple[RpcAgent, RpcAgent]) -> None:
    a, b = pair
    await a.rpc_async("b", record_call, ("dial",))
    a.notify("b", "test.record", "never handled")
    await b.shutdown(graceful=False)
    async with asyncio.timeout(5):
        await a.notices_delivered()  # returns: b is gone, not waited for
    assert a.debug_info()["queued_notices"] == 0


def hold_dials(agent: RpcAgent, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Hold every dial of ``agent`` until the returned event is set (a peer whose
    accept or handshake is held up)."""
    reachable = asyncio.Event()
    dial = agent._dial

    async def held_up(peer: str) -> Any:
        await reachable.wait()
        return await dial(peer)

    monkeypatch.setattr(agent, "_dial", held_up)
    return reachable


async def test_a_notice_on_a_call_that_times_out_while_dialing_is_still_delivered(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call never leaves, but the notice in its header must, and
    notices_delivered() must wait for it."""
    a, _ = pair
    reachable = hold_dials(a, monkeypatch)
    a.notify("b", "test.record", "riding")
    with pytest.raises(RPCTimeoutError):
        await a.rpc_async("b", record_call, ("timed out",), timeout=0.05)
    delivered = asyncio.ensure_future(a.notices_delivered())
    for _ in range(10):
        await asyncio.sleep(0)
    assert not delivered.done()  # b cannot be reached yet
    reachable.set()
    async with asyncio.timeout(5):
        await delivered
    assert seen == [("b", 0, "riding")]  # and the timed-out call never ran


def fail_next_dial(agent: RpcAgent, monkeypatch: pytest.MonkeyPatch, cause: Exception) -> None:
    """Make ``agent``'s next dial fail with ``cause`` (as ``_dial`` wraps it)."""
    dial = agent._dial

    async def failing(peer: str) -> Any:
        monkeypatch.setattr(agent, "_dial", dial)
        raise PeerLostError(f"cannot connect to worker {peer!r}: {cause}", worker=peer) from cause

    monkeypatch.setattr(agent, "_dial", failing)


async def test_a_notice_on_a_call_to_a_busy_peer_goes_with_the_next_message(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dial that times out in the handshake reached a live worker (its loop was
    busy): the call fails, its notice waits for the next message to that worker."""
    a, _ = pair
    fail_next_dial(a, monkeypatch, HandshakeError("handshake timed out", timed_out=True))
    a.notify("b", "test.record", "riding")
    with pytest.raises(PeerLostError):
        await a.rpc_async("b", record_call, ("failed",))
    assert a.debug_info()["queued_notices"] == 1
    await a.rpc_async("b", record_call, ("next",))
    assert seen == [("b", 0, "riding"), ("call", -1, "next")]


async def test_a_notice_for_a_peer_that_cannot_be_reached_is_dropped(
    pair: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    fail_next_dial(a, monkeypatch, ConnectionRefusedError("refused"))
    a.notify("b", "test.record", "lost")
    with pytest.raises(PeerLostError):
        await a.rpc_async("b", record_call, ("failed",))
    assert a.debug_info()["queued_notices"] == 0
    await a.rpc_async("b", record_call, ("next",))
    assert seen == [("call", -1, "next")]
