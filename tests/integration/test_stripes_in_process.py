"""Striped tcp links between agents on one loop: large buffers cross side connections
(transport/stripes.py), messages keep their order around them, a link whose side
connections cannot be made carries everything itself, and a side connection lost in
use loses its link, which the next call dials anew."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from asyncrpc.agent import AgentOptions, RpcAgent, on_loop
from asyncrpc.errors import PeerLostError
from asyncrpc.transport import Link
from asyncrpc.transport.stripes import STRIPE_MIN, Stripes
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(60)
OPTIONS = AgentOptions(transports=("tcp",), shared_memory=False, rpc_timeout=20)
BIG = STRIPE_MIN + 3 * 4096 + 4  # bytes: striped, pieces of unequal length
arrivals: list[int] = []
release = threading.Event()
started = threading.Event()


def big(seed: int) -> torch.Tensor:
    return torch.arange(BIG // 4, dtype=torch.int32) * seed


def echo(x: Any) -> Any:
    return x


def total(xs: list[torch.Tensor]) -> int:
    return sum(int(x[-1]) for x in xs)


@on_loop
def arrive(i: int, x: torch.Tensor | None) -> int:
    """Runs on the callee's loop as its request arrives: records the arrival order."""
    arrivals.append(i)
    return i if x is None else int(x[-1])


def wait_for_release(x: torch.Tensor) -> int:
    started.set()
    release.wait(30)
    return x.numel()


def striped(agent: RpcAgent) -> dict[str, int]:
    return agent.debug_info()["bytes"].get("tcp_stripes", {"sent": 0, "received": 0})


def inbound(agent: RpcAgent) -> Link:
    (link,) = agent._inbound.links
    return link


def closed_without_answer(sock: socket.socket) -> bool:
    """The peer closed ``sock`` (or reset it: it left our bytes unread) and sent nothing."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (10 s at most) for ``condition``, which another thread or the loop makes true."""
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


async def test_a_first_large_call_waits_for_the_side_connections_and_crosses_them() -> None:
    """The very first call of a pair carries a striped buffer both ways: it waits until
    the side connections are up (no inline fallback), and its bytes cross them."""
    async with joined_agents("ab", OPTIONS) as (a, b):
        x = big(3)
        assert torch.equal(await a.rpc_async("b", echo, (x,)), x)
        assert striped(a)["sent"] >= BIG and striped(a)["received"] >= BIG
        assert a.debug_info()["bytes"]["tcp"]["sent"] < 1 << 20  # the frames only
        link = a.debug_info()["links"]["b"]
        assert (link["stripes"], link["stripes_why"]) == (2, "both ends offered them")
        assert inbound(b).striping == {"stripes": 2, "stripes_why": "both ends offered them"}


async def test_messages_keep_their_order_around_striped_buffers() -> None:
    """Calls sent back to back, small and striped, arrive in the order they were sent; a
    request with several large buffers arrives whole."""
    arrivals.clear()
    async with joined_agents("ab", OPTIONS) as (a, b):
        calls = [
            a.rpc_async("b", arrive, (0, torch.ones(10))),
            a.rpc_async("b", arrive, (1, big(5))),
            a.rpc_async("b", arrive, (2, None)),
            a.rpc_async("b", arrive, (3, big(7))),
            a.rpc_async("b", arrive, (4, torch.ones(1 << 20))),
        ]
        results = await asyncio.gather(*calls)
        assert arrivals == [0, 1, 2, 3, 4]
        assert results == [1, int(big(5)[-1]), 2, int(big(7)[-1]), 1]
        xs = [big(1), torch.ones(8), big(2)]
        assert await a.rpc_async("b", total, (xs,)) == total(xs)
        assert striped(b)["received"] >= 4 * BIG


@pytest.mark.parametrize("off", ["a", "b"])
async def test_tcp_stripes_0_on_either_side_leaves_the_link_unstriped(off: str) -> None:
    options = [replace(OPTIONS, tcp_stripes=0 if name == off else 2) for name in "ab"]
    async with joined_agents("ab", options) as (a, b):
        x = big(3)
        assert torch.equal(await a.rpc_async("b", echo, (x,)), x)
        why = "tcp_stripes=0 here" if off == "a" else "the peer offers none"
        assert (
            a.debug_info()["links"]["b"] | {"stripes": 0, "stripes_why": why}
            == (a.debug_info()["links"]["b"])
        )
        assert striped(a) == striped(b) == {"sent": 0, "received": 0}
        assert a.debug_info()["bytes"]["tcp"]["received"] >= BIG


async def test_side_connections_that_cannot_be_made_leave_the_link_unstriped() -> None:
    """Nobody listens at the peer's side-connection port (a firewall that lets only the
    main port through): the first large call goes through the link's stream at once,
    and the listener is told not to wait."""
    async with joined_agents("ab", OPTIONS) as (a, b):
        assert b._stripe_listener is not None
        b._stripe_listener.close()
        x = big(3)
        assert torch.equal(await a.rpc_async("b", echo, (x,)), x)
        link = a.debug_info()["links"]["b"]
        assert link["stripes"] == 0
        assert link["stripes_why"].startswith("side connections failed: [Errno 111]")
        await until(lambda: inbound(b).striping["stripes_why"] != "connecting", "told")
        assert (
            inbound(b)
            .striping["stripes_why"]
            .startswith("the peer could not connect them (side connections failed: [Errno 111]")
        )
        assert striped(a) == {"sent": 0, "received": 0}


async def test_side_connections_not_up_in_time_are_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dialer that never connects them (here: its dial does nothing): both ends give
    up after ``handshake_timeout``, and the large call that waited goes inline."""
    monkeypatch.setattr(Stripes, "dial", lambda *args, **kwargs: None)
    options = replace(OPTIONS, handshake_timeout=0.5)
    async with joined_agents("ab", options) as (a, b):
        x = big(3)
        assert torch.equal(await a.rpc_async("b", echo, (x,)), x)
        assert a.debug_info()["links"]["b"]["stripes_why"] == (
            "side connections failed: not up within 0.5s"
        )
        assert inbound(b).striping["stripes"] == 0
        assert striped(a) == {"sent": 0, "received": 0}


async def test_a_lost_side_connection_fails_the_calls_on_its_link_and_the_next_call_redials() -> (
    None
):
    release.clear()
    started.clear()
    async with joined_agents("ab", OPTIONS) as (a, _):
        x = big(3)
        assert torch.equal(await a.rpc_async("b", echo, (x,)), x)
        link = a._links["b"]
        waiting = a.rpc_async("b", wait_for_release, (torch.ones(4),))
        assert await asyncio.to_thread(started.wait, 10)  # the call runs on b
        stripes = link._stripes
        assert stripes is not None
        stripes._sockets[0].shutdown(socket.SHUT_RDWR)
        # (whichever end's loop hears of it first: ours, or b's dropping the link)
        lost_words = r"worker 'b': (side connection lost|closed the connection|connection lost)"
        with pytest.raises(PeerLostError, match=lost_words) as lost:
            await waiting
        assert lost.value.worker == "b"
        release.set()
        assert torch.equal(await a.rpc_async("b", echo, (x,)), x)
        assert a._links["b"] is not link
        assert a.debug_info()["links"]["b"]["stripes"] == 2


async def test_garbage_at_the_side_connection_port_is_refused_and_the_worker_serves_on() -> None:
    async with joined_agents("ab", OPTIONS) as (a, b):
        assert b._stripe_listener is not None
        port = b._stripe_listener.port
        for junk in (b"GET / HTTP/1.0\r\n\r\n" + bytes(100), b"ARS1" + bytes(66), b"\xff" * 3):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(junk)
                if len(junk) < 70:
                    sock.shutdown(socket.SHUT_WR)  # a truncated HELLO: then nothing
                assert closed_without_answer(sock)
        x = big(3)
        assert torch.equal(await a.rpc_async("b", echo, (x,)), x)
        assert striped(a)["sent"] >= BIG
