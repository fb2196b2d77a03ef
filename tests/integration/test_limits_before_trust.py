"""Limits before trust, on real agents over loopback sockets (issue 12).

* An unauthenticated connection may announce only small handshake frames: a huge one
  is refused from its header, before anything is allocated, and the worker serves on.
* Unauthenticated connections are few (``max_pending_handshakes``) and small (a 4 KiB
  staging area each).
* Each end of a link knows the other's ``max_frame_size``: a message too large for the
  receiver fails alone on the sending side, and the link stays up.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import replace

import msgpack
import pytest

from asyncrpc.agent import AgentOptions, RpcAgent
from asyncrpc.errors import LocalProtocolError, PeerLostError
from asyncrpc.wire import Kind
from asyncrpc.wire.codec import MAGIC, PRELUDE
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


@pytest.fixture(params=["unix", "tcp"])
def options(request: pytest.FixtureRequest) -> AgentOptions:
    return AgentOptions(transports=(request.param,), rpc_timeout=10)


def add(x: int, y: int) -> int:
    return x + y


def size_of(data: bytes) -> int:
    return len(data)


def make_bytes(n: int) -> bytes:
    return b"r" * n


async def make_bytes_on_the_loop(n: int) -> bytes:
    return b"r" * n


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


async def raw_connection(agent: RpcAgent) -> socket.socket:
    """A connection to ``agent`` that says nothing unless told to (no handshake)."""
    address = next(iter(agent.address.addresses.values()))
    if address.startswith("tcp://"):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        sock, target = socket.socket(socket.AF_INET), (host, int(port))
    else:
        sock, target = socket.socket(socket.AF_UNIX), "\0" + address.removeprefix("unix://@")
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, target)
    return sock


async def closed_by_peer(sock: socket.socket) -> bool:
    """Wait until the other end closes ``sock`` (True), or sends something (False)."""
    try:
        return await asyncio.get_running_loop().sock_recv(sock, 1) == b""
    except ConnectionResetError:
        return True


async def until(condition: Callable[[], bool], limit: float = 5.0) -> None:
    """Wait (bounded) for a condition that the agents' loop, ours, makes true."""
    async with asyncio.timeout(limit):
        while not condition():
            await asyncio.sleep(0)


def header(kind: int, payload: int, buffers: list[int]) -> bytes:
    packed = msgpack.packb([kind, {}, payload, buffers])
    return PRELUDE.pack(MAGIC, 0, len(packed)) + packed


HUGE = int(7.9 * 2**30)
ANNOUNCEMENTS = {
    "7.9 GiB HELLO": header(Kind.HELLO, HUGE, []),
    "7.9 GiB buffer in a REQUEST": header(Kind.REQUEST, 0, [HUGE]),
    "60 KB header": PRELUDE.pack(MAGIC, 0, 60_000),
}


# -- (i) a huge frame before the handshake ---------------------------------------------


@pytest.mark.parametrize("announced", sorted(ANNOUNCEMENTS))
async def test_a_huge_frame_before_the_handshake_is_refused_from_its_header(
    options: AgentOptions, announced: str
) -> None:
    async with joined_agents("ab", options) as (a, b):
        assert await a.rpc_async("b", add, args=(1, 2)) == 3  # a's link to b is up
        sock = await raw_connection(b)
        before = resident_bytes()
        started = time.monotonic()
        await asyncio.get_running_loop().sock_sendall(sock, ANNOUNCEMENTS[announced])
        assert await asyncio.wait_for(closed_by_peer(sock), 2)
        closed_after = time.monotonic() - started
        grown = resident_bytes() - before
        sock.close()
        # ...and a call on the other link is answered at once: b's loop never stalled.
        assert await asyncio.wait_for(a.rpc_async("b", add, args=(2, 2)), 2) == 4
    assert closed_after < 1.0
    assert grown < 4 * MiB, f"resident memory grew by {grown / MiB:.1f} MiB"


# -- (ii) many unauthenticated connections ---------------------------------------------


def accepted(agent: RpcAgent) -> int:
    info = agent.debug_info()
    return int(info["pending_handshakes"] + info["refused_connections"])


async def test_unauthenticated_connections_are_few_and_small(options: AgentOptions) -> None:
    cap = options.max_pending_handshakes
    assert cap == 64
    async with joined_agents("abc", options) as (a, b, c):
        assert await a.rpc_async("b", add, args=(1, 2)) == 3
        before = resident_bytes()
        socks: list[socket.socket] = []
        for _ in range(200):  # one by one, each accepted before the next (the backlog)
            socks.append(await raw_connection(b))
            await until(lambda: accepted(b) == len(socks))
        # The first `cap` wait for their handshake; every later one is closed at once.
        refused = await asyncio.wait_for(asyncio.gather(*map(closed_by_peer, socks[cap:])), 5)
        assert all(refused)
        grown = resident_bytes() - before
        info = b.debug_info()
        assert (info["pending_handshakes"], info["refused_connections"]) == (cap, 200 - cap)
        # An authenticated link is served as ever; a new peer must wait for a free slot.
        assert await asyncio.wait_for(a.rpc_async("b", add, args=(2, 2)), 2) == 4
        with pytest.raises(PeerLostError, match="'b'"):
            await c.rpc_async("b", add, args=(0, 0))
        for sock in socks:
            sock.close()
        await until(lambda: b.debug_info()["pending_handshakes"] == 0)  # lost: not counted
        assert await asyncio.wait_for(c.rpc_async("b", add, args=(3, 4)), 2) == 7
        assert b.debug_info()["pending_handshakes"] == 0  # established: not counted either
    # 256 KiB of staging each used to make this 50 MiB for 200 connections.
    assert grown < 4 * MiB, f"resident memory grew by {grown / MiB:.1f} MiB"


# -- (iii) a max_frame_size mismatch ---------------------------------------------------

LIMIT = 64 * 1024
PEERS_LIMIT = rf"worker 'b' accepts {LIMIT}, worker 'a' accepts 8589934592 bytes"


@pytest.fixture
async def mismatched(options: AgentOptions) -> tuple[RpcAgent, RpcAgent]:
    """``a`` accepts 8 GiB (the default), ``b`` only 64 KiB."""
    async with joined_agents("ab", [options, replace(options, max_frame_size=LIMIT)]) as (a, b):
        yield a, b


async def test_a_call_too_large_for_the_callee_fails_alone(
    mismatched: tuple[RpcAgent, RpcAgent],
) -> None:
    a, _ = mismatched
    data = b"x" * (LIMIT + 1000)
    # The link is dialed for this call: the call fails through its future...
    with pytest.raises(LocalProtocolError, match=f"call to .*size_of on worker 'b'.*{PEERS_LIMIT}"):
        await a.rpc_async("b", size_of, args=(data,))
    link = a._links["b"]
    # ...and now that the link knows b's limit, at once, leaving nothing pending.
    with pytest.raises(LocalProtocolError, match=PEERS_LIMIT) as raised:
        a.rpc_async("b", size_of, args=(data,))
    assert (raised.value.worker, raised.value.function) == ("b", f"{__name__}.size_of")
    assert a.debug_info()["pending_outgoing_calls"] == 0
    assert await a.rpc_async("b", size_of, args=(data[:1000],)) == 1000
    assert a._links["b"] is link and not link.closed  # the same link: it was never dropped


@pytest.mark.parametrize("function", [make_bytes, make_bytes_on_the_loop])
async def test_a_reply_too_large_for_the_caller_fails_alone(
    mismatched: tuple[RpcAgent, RpcAgent], function: Callable[[int], object]
) -> None:
    """Replies made in a pool thread and on the loop alike become an ERROR reply."""
    _, b = mismatched
    what = rf"reply of .*{function.__name__} from worker 'a' to worker 'b'"
    limits = rf"worker 'b' accepts {LIMIT}, worker 'a' accepts 8589934592 bytes"
    with pytest.raises(LocalProtocolError, match=rf"{what} carries \d+ bytes.*{limits}"):
        await b.rpc_async("a", function, args=(LIMIT + 1,))
    link = b._links["a"]
    assert await b.rpc_async("a", function, args=(1000,)) == b"r" * 1000
    assert b._links["a"] is link and not link.closed
