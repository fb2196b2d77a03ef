"""Unit tests for side connections (transport.stripes): real sockets, real threads, a
real loop.  What matters: a buffer crosses them intact whichever of its frame and its
pieces comes first; anything malformed from the peer fails the link; the listener
hands a side connection only to the link it proves it belongs to."""

from __future__ import annotations

import asyncio
import itertools
import queue
import random
import re
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.transport.stripes import (
    ACK,
    CHUNK,
    HEADER,
    HELLO,
    MAGIC,
    MAX_STRIPES,
    STRIPE_KEY,
    Prove,
    StripeListener,
    Stripes,
    is_striped,
)
from asyncrpc.wire.handshake import Handshake, Identity, Role

SECRET = b"job-secret-0123456789"
MiB = 1 << 20
MAX_BYTES = 64 * MiB
WAIT = 10.0  # seconds: the bound on anything awaited (a pass takes milliseconds)


# -- helpers -----------------------------------------------------------------------------


class Events:
    """A link as side connections see it: records each report (on the loop's thread)
    and wakes whoever waits for it."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self.calls: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()
        self.sent = asyncio.Event()
        self.failed: asyncio.Future[BaseException] = self._loop.create_future()
        self._arrivals: dict[int, asyncio.Future[None]] = {}

    def arrival(self, key: int) -> asyncio.Future[None]:
        return self._arrivals.setdefault(key, self._loop.create_future())

    def _call(self, name: str, arg: Any) -> None:
        assert threading.get_ident() == self._thread, "reported off the loop's thread"
        self.calls.append((name, arg))

    def stripes_ready(self) -> None:
        self._call("ready", None)
        self.ready.set()

    def stripe_arrived(self, key: int) -> None:
        self._call("arrived", key)
        if not self.arrival(key).done():
            self.arrival(key).set_result(None)

    def stripes_sent(self) -> None:
        self._call("sent", None)
        self.sent.set()

    def stripes_failed(self, exc: BaseException) -> None:
        self._call("failed", exc)
        if not self.failed.done():
            self.failed.set_result(exc)

    def named(self, name: str) -> list[Any]:
        return [arg for call, arg in self.calls if call == name]


class Allocator:
    """Fresh storage for a received buffer: a bytearray and its view; records sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> tuple[bytearray, memoryview]:
        self.sizes.append(nbytes)
        owner = bytearray(nbytes)
        return owner, memoryview(owner)


@dataclass
class End:
    """One link's side connections and what they reported."""

    stripes: Stripes
    events: Events
    allocator: Allocator
    name: str


def no_proof(dialer: bool, index: int) -> bytes:
    return b"\x00" * 32


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected loopback tcp sockets (``attach`` sets tcp options: no AF_UNIX)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=WAIT)
        accepted, _ = server.accept()
    accepted.settimeout(WAIT)
    return client, accepted


def payload(nbytes: int) -> bytes:
    return random.Random(nbytes).randbytes(nbytes)


def recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        got = sock.recv(nbytes - len(data))
        assert got, f"closed after {len(data)} of {nbytes} bytes"
        data += got
    return data


def refused(sock: socket.socket) -> bool:
    """Whether the listener closed ``sock`` without a word (no ACK)."""
    try:
        return sock.recv(ACK.size) == b""
    except ConnectionResetError:
        return True


def established(secret: bytes = SECRET) -> tuple[Handshake, Handshake]:
    """A dialer's and a listener's Handshake of one connection, through WELCOME."""
    dialer = Handshake(Role.DIALER, secret, Identity("trainer", 1, 1111, "host-a"))
    listener = Handshake(Role.LISTENER, secret, Identity("ps", 0, 2222, "host-b"))
    to_listener = dialer.start()
    while to_listener:
        to_dialer = [out for kind, meta in to_listener for out in listener.receive(kind, meta)]
        to_listener = [out for kind, meta in to_dialer for out in dialer.receive(kind, meta)]
    assert dialer.established and listener.established
    return dialer, listener


def pieces(nbytes: int, count: int) -> int:
    """How many pieces ``send`` cuts a buffer of ``nbytes`` into, over ``count``."""
    chunk = min(CHUNK, -(-nbytes // count))
    return -(-nbytes // chunk)


class Harness:
    """Makes Ends, sockets and listeners, and closes them all after the test, waiting
    for every thread they started to end."""

    def __init__(self) -> None:
        self._ends: list[End] = []
        self._sockets: list[socket.socket] = []
        self._listeners: list[StripeListener] = []

    def end(
        self,
        count: int = 2,
        *,
        prove: Prove = no_proof,
        max_bytes: int = MAX_BYTES,
        confirmed: bool = True,
    ) -> End:
        events, allocator = Events(), Allocator()
        name = f"end{len(self._ends)}"
        stripes = Stripes(
            count, events, asyncio.get_running_loop().call_soon_threadsafe, prove=prove,
            allocate=allocator, max_bytes=max_bytes, silence_timeout=30.0, name=name,
            confirmed=confirmed,
        )  # fmt: skip
        end = End(stripes, events, allocator, name)
        self._ends.append(end)
        return end

    def pair(self) -> tuple[socket.socket, socket.socket]:
        pair = tcp_pair()
        self._sockets += pair
        return pair

    def track(self, sock: socket.socket) -> socket.socket:
        self._sockets.append(sock)
        return sock

    def listener(self, count: int = 2, timeout: float = WAIT) -> StripeListener:
        listener = StripeListener("127.0.0.1", count, timeout=timeout)
        self._listeners.append(listener)
        return listener

    def connect(self, end: End) -> tuple[list[socket.socket], list[socket.socket]]:
        """Attach every side connection of ``end`` to a fresh tcp pair: (its sockets,
        the raw other ends)."""
        ours, raws = [], []
        for index in range(end.stripes.count):
            mine, raw = self.pair()
            end.stripes.attach(index, mine)
            ours.append(mine)
            raws.append(raw)
        return ours, raws

    def join(self, a: End, b: End) -> None:
        """Side connections between ``a`` and ``b``."""
        assert a.stripes.count == b.stripes.count
        for index in range(a.stripes.count):
            x, y = self.pair()
            a.stripes.attach(index, x)
            b.stripes.attach(index, y)

    async def joined(self) -> tuple[End, End]:
        """Two ends of 2 side connections, joined and ready."""
        a, b = self.end(), self.end()
        self.join(a, b)
        await ready(a, b)
        return a, b

    async def threads_ended(self, end: End) -> None:
        """Wait (bounded) until every thread of ``end`` has returned."""
        mine = [t for t in threading.enumerate() if _of(t, end.name)]
        await asyncio.to_thread(_join_all, mine)
        assert not [t for t in mine if t.is_alive()], "threads still running"

    async def close(self) -> None:
        for end in self._ends:
            end.stripes.close()
        for listener in self._listeners:
            listener.close()
        for sock in self._sockets:
            sock.close()
        for end in self._ends:
            await self.threads_ended(end)


def _of(thread: threading.Thread, name: str) -> bool:
    return thread.name.startswith((f"asyncrpc-stripe-{name}-", f"asyncrpc-stripes-dial-{name}"))


def _join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(WAIT)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    made = Harness()
    try:
        yield made
    finally:
        await made.close()


async def crosses(sender: End, receiver: End, nbytes: int) -> None:
    """A buffer of ``nbytes`` sent by ``sender`` arrives whole; the sender says it left."""
    data = payload(nbytes)
    key = sender.stripes.next_key()
    sender.stripes.send([(key, memoryview(data))])
    await arrived(receiver, key)
    assert receiver.stripes.claim(key, nbytes) == (data, True)
    await asyncio.wait_for(sender.events.sent.wait(), WAIT)


async def ready(*ends: End) -> None:
    for end in ends:
        await asyncio.wait_for(end.events.ready.wait(), WAIT)
        assert end.stripes.ready


async def failure(end: End) -> BaseException:
    return await asyncio.wait_for(asyncio.shield(end.events.failed), WAIT)


async def arrived(end: End, *keys: int) -> None:
    await asyncio.wait_for(asyncio.gather(*(end.events.arrival(k) for k in keys)), WAIT)


# -- sending and receiving ---------------------------------------------------------------


async def test_ready_is_reported_once_every_side_connection_is_attached(
    harness: Harness,
) -> None:
    end = harness.end(count=2)
    mine, _ = harness.pair()
    end.stripes.attach(0, mine)
    await asyncio.sleep(0)  # a turn of the loop: anything scheduled has run
    assert not end.stripes.ready and end.events.calls == []
    mine, _ = harness.pair()
    end.stripes.attach(1, mine)
    await ready(end)
    assert end.events.calls == [("ready", None)]


async def test_a_second_socket_for_an_index_is_closed(harness: Harness) -> None:
    end = harness.end(count=2)
    first, _ = harness.pair()
    second, _ = harness.pair()
    end.stripes.attach(0, first)
    end.stripes.attach(0, second)
    assert second.fileno() == -1 and first.fileno() != -1
    await asyncio.sleep(0)
    assert not end.stripes.ready


async def test_a_buffer_claimed_before_its_pieces_arrive_intact(harness: Harness) -> None:
    """9 MiB + 3 bytes: pieces of 4 MiB, 4 MiB and 1 MiB + 3, dealt over both streams."""
    a, b = await harness.joined()
    nbytes = 9 * MiB + 3
    data = payload(nbytes)
    key = a.stripes.next_key()
    assert is_striped(key)
    owner, complete = b.stripes.claim(key, nbytes)
    assert not complete and b.allocator.sizes == [nbytes]
    a.stripes.send([(key, memoryview(data))])
    await arrived(b, key)
    assert owner == data
    assert b.events.named("arrived") == [key]
    await asyncio.wait_for(a.events.sent.wait(), WAIT)
    assert a.stripes.sending == 0 and a.events.named("sent") == [None]
    assert pieces(nbytes, 2) == 3
    assert a.stripes.bytes_sent == b.stripes.bytes_received == nbytes + 3 * HEADER.size
    assert b.stripes.bytes_sent == a.stripes.bytes_received == 0
    assert not a.events.failed.done() and not b.events.failed.done()


async def test_a_buffer_claimed_after_its_pieces_arrived_is_complete(harness: Harness) -> None:
    a, b = await harness.joined()
    nbytes = 9 * MiB + 3
    data = payload(nbytes)
    key = a.stripes.next_key()
    a.stripes.send([(key, memoryview(data))])
    await arrived(b, key)
    owner, complete = b.stripes.claim(key, nbytes)
    assert complete and owner == data
    assert b.allocator.sizes == [nbytes]  # the pieces made it; the claim found it


async def test_two_buffers_in_one_send(harness: Harness) -> None:
    a, b = await harness.joined()
    sizes = (5 * MiB + 1, 3 * MiB + 7)
    datas = [payload(n) for n in sizes]
    keys = [a.stripes.next_key(), a.stripes.next_key()]
    assert len(set(keys)) == 2
    first, _ = b.stripes.claim(keys[0], sizes[0])  # one claimed before, one after
    a.stripes.send([(k, memoryview(d)) for k, d in zip(keys, datas, strict=True)])
    await arrived(b, *keys)
    second, complete = b.stripes.claim(keys[1], sizes[1])
    assert complete
    assert (first, second) == tuple(datas)
    await asyncio.wait_for(a.events.sent.wait(), WAIT)
    assert a.events.named("sent") == [None]  # once, when every piece of both left
    headers = (pieces(sizes[0], 2) + pieces(sizes[1], 2)) * HEADER.size
    assert a.stripes.bytes_sent == b.stripes.bytes_received == sum(sizes) + headers


async def test_buffers_cross_both_ways_and_sent_is_reported_per_batch(
    harness: Harness,
) -> None:
    a, b = await harness.joined()
    for sender, receiver, nbytes in ((a, b, 1000), (b, a, 3 * MiB + 1), (a, b, 1)):
        sender.events.sent.clear()
        await crosses(sender, receiver, nbytes)
    assert (len(a.events.named("sent")), len(b.events.named("sent"))) == (2, 1)


async def test_a_buffer_of_another_format_or_shape_leaves_as_its_bytes(
    harness: Harness,
) -> None:
    a, b = await harness.joined()
    data = payload(4096)
    views = [memoryview(data).cast("I"), memoryview(data).cast("B", (64, 64))]
    keys = [a.stripes.next_key() for _ in views]
    a.stripes.send(list(zip(keys, views, strict=True)))
    await arrived(b, *keys)
    for key in keys:
        assert b.stripes.claim(key, 4096) == (data, True)


# -- a malformed peer fails the link -----------------------------------------------------


KEY = STRIPE_KEY | 1
BAD_HEADERS: dict[str, tuple[bytes, str]] = {
    "piece past its buffer": (
        HEADER.pack(KEY, 100, 60, 50),
        r"striped piece \[60, 110\) outside its buffer of 100 bytes",
    ),
    "piece past the end of 64 bits": (
        HEADER.pack(KEY, 100, 2**64 - 1, 2),
        r"outside its buffer of 100 bytes",
    ),
    "empty piece": (HEADER.pack(KEY, 100, 0, 0), r"\[0, 0\) outside its buffer of 100 bytes"),
    "buffer above max_bytes": (
        HEADER.pack(KEY, MAX_BYTES + 1, 0, 10),
        rf"striped buffer of {MAX_BYTES + 1} bytes \(max_frame_size {MAX_BYTES}\)",
    ),
    "empty buffer": (HEADER.pack(KEY, 0, 0, 0), r"striped buffer of 0 bytes"),
    # The message must name the key as the fault, not the buffer's (acceptable) size.
    "key without STRIPE_KEY": (HEADER.pack(7, 100, 0, 100), r"(?i)key"),
    # Pieces lie where the sender's layout puts them (here 2 of 50), so none overlap.
    "piece off the layout": (HEADER.pack(KEY, 100, 10, 50), r"\[10, 60\) outside its buffer"),
    "piece of another length": (HEADER.pack(KEY, 100, 0, 40), r"\[0, 40\) outside its buffer"),
    "the same piece twice": (
        HEADER.pack(KEY, 100, 0, 50) + bytes(50) + HEADER.pack(KEY, 100, 0, 50),
        r"striped piece at 0 received twice",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_HEADERS))
async def test_a_malformed_piece_header_fails_the_link(harness: Harness, name: str) -> None:
    header, message = BAD_HEADERS[name]
    end = harness.end(count=2)
    _, raws = harness.connect(end)
    await ready(end)
    raws[1].sendall(header)
    exc = await failure(end)
    assert isinstance(exc, RemoteProtocolError)
    assert re.search(message, str(exc)), str(exc)
    if "max_bytes" in name:
        assert end.allocator.sizes == []  # nothing allocated on the peer's word


async def test_pieces_that_say_another_size_than_the_claim_fail_the_link(
    harness: Harness,
) -> None:
    end = harness.end(count=1)
    _, (raw,) = harness.connect(end)
    await ready(end)
    end.stripes.claim(KEY, 100)
    raw.sendall(HEADER.pack(KEY, 200, 0, 200))
    exc = await failure(end)
    assert isinstance(exc, RemoteProtocolError)
    assert "striped buffer 1 said to hold 200 bytes and 100" in str(exc)


async def test_a_claim_of_another_size_than_the_pieces_raises(harness: Harness) -> None:
    end = harness.end(count=1)
    _, (raw,) = harness.connect(end)
    await ready(end)
    raw.sendall(HEADER.pack(KEY, 100, 0, 100) + payload(100))
    await arrived(end, KEY)
    with pytest.raises(RemoteProtocolError, match="said to hold 200 bytes and 100"):
        end.stripes.claim(KEY, 200)


async def test_a_key_claimed_twice_while_arriving_raises(harness: Harness) -> None:
    end = harness.end(count=1)
    harness.connect(end)
    await ready(end)
    end.stripes.claim(KEY, 100)
    with pytest.raises(RemoteProtocolError, match="striped buffer 1 claimed twice"):
        end.stripes.claim(KEY, 100)


@pytest.mark.parametrize("first_claim", ["before its pieces", "after its pieces"])
async def test_a_key_claimed_again_once_complete_raises(harness: Harness, first_claim: str) -> None:
    """A frame naming a buffer that was delivered already is the peer's error (keys are
    never reused), not a new buffer to wait for: the link would hold it, and every
    message behind it, for ever."""
    end = harness.end(count=1)
    _, (raw,) = harness.connect(end)
    await ready(end)
    data = payload(100)
    if first_claim == "before its pieces":
        owner, complete = end.stripes.claim(KEY, 100)
        assert not complete
    raw.sendall(HEADER.pack(KEY, 100, 0, 100) + data)
    await arrived(end, KEY)
    if first_claim == "after its pieces":
        owner, complete = end.stripes.claim(KEY, 100)
        assert complete
    assert owner == data
    with pytest.raises(RemoteProtocolError, match="claimed twice"):
        end.stripes.claim(KEY, 100)


# -- losing and closing ------------------------------------------------------------------


async def test_eof_on_a_side_connection_fails_the_link(harness: Harness) -> None:
    end = harness.end(count=2)
    _, raws = harness.connect(end)
    await ready(end)
    raws[0].close()
    exc = await failure(end)
    assert isinstance(exc, ConnectionError) and "closed" in str(exc)
    assert end.events.named("failed") == [exc]


async def test_after_close_nothing_is_reported_or_sent(harness: Harness) -> None:
    end = harness.end(count=2)
    ours, raws = harness.connect(end)
    await ready(end)
    end.stripes.claim(KEY, 100)
    raws[0].sendall(HEADER.pack(KEY, 100, 0, 10))  # a piece begun
    end.stripes.close()
    assert all(sock.fileno() == -1 for sock in ours)
    for raw in raws:
        assert raw.recv(1) == b""  # the peer sees the side connections end
        raw.close()
    end.stripes.send([(end.stripes.next_key(), memoryview(payload(1000)))])
    assert end.stripes.sending == 0
    end.stripes.close()  # twice is harmless
    await harness.threads_ended(end)  # readers and writers saw their sockets end...
    await asyncio.sleep(0)  # ...and anything they scheduled has run
    assert end.events.calls == [("ready", None)]


async def test_a_socket_attached_after_close_is_closed(harness: Harness) -> None:
    end = harness.end(count=1)
    end.stripes.close()
    mine, _ = harness.pair()
    end.stripes.attach(0, mine)
    assert mine.fileno() == -1
    await asyncio.sleep(0)
    assert end.events.calls == []


# -- proofs from the link's handshake ----------------------------------------------------


def test_stripe_proofs_agree_across_ends_and_differ_by_role_index_and_connection() -> None:
    dialer, listener = established()
    other, _ = established()
    assert dialer.link_id == listener.link_id and len(dialer.link_id) == 32
    assert other.link_id != dialer.link_id
    proofs = set()
    for role in (True, False):
        for index in range(3):
            proof = dialer.stripe_proof(role, index)
            assert proof == listener.stripe_proof(role, index) and len(proof) == 32
            assert proof != other.stripe_proof(role, index)
            proofs.add(proof)
    assert len(proofs) == 6
    _, stranger = established(secret=b"another job")
    assert stranger.stripe_proof(True, 0) != dialer.stripe_proof(True, 0)


# -- the listener ------------------------------------------------------------------------


def hello(dialer: Handshake, index: int, proof: bytes | None = None) -> bytes:
    if proof is None:
        proof = dialer.stripe_proof(True, index)
    return HELLO.pack(MAGIC, dialer.link_id, index, proof)


def greet(harness: Harness, listener: StripeListener, message: bytes) -> socket.socket:
    """A connection to ``listener`` that sent ``message``."""
    sock = harness.track(socket.create_connection(("127.0.0.1", listener.port), timeout=WAIT))
    sock.sendall(message)
    return sock


def side_connection(
    harness: Harness, listener: StripeListener, dialer: Handshake, index: int
) -> socket.socket:
    """A side connection as a link's dialer makes it: HELLO, and the listener's ACK."""
    sock = greet(harness, listener, hello(dialer, index))
    magic, proof = ACK.unpack(recv_exactly(sock, ACK.size))
    assert magic == MAGIC
    assert proof == dialer.stripe_proof(False, index)  # the listener's, not ours echoed
    assert proof != dialer.stripe_proof(True, index)
    return sock


async def test_the_listener_hands_each_side_connection_to_its_link(harness: Harness) -> None:
    listener = harness.listener(count=2)
    dialer, ours = established()
    other_dialer, other = established()
    a = harness.end(count=2, prove=ours.stripe_proof)
    b = harness.end(count=1, prove=other.stripe_proof)
    listener.expect(ours.link_id, a.stripes)
    listener.expect(other.link_id, b.stripes)
    socks = [side_connection(harness, listener, dialer, index) for index in range(2)]
    await ready(a)
    assert b.events.calls == [] and not b.stripes.ready
    data = payload(1000)
    for index, offset in enumerate((0, 500)):  # two pieces, one a connection: a's buffer
        socks[index].sendall(HEADER.pack(KEY, 1000, offset, 500) + data[offset : offset + 500])
    await arrived(a, KEY)
    assert a.stripes.claim(KEY, 1000) == (data, True)
    side_connection(harness, listener, other_dialer, 0)
    await ready(b)


BAD_GREETINGS: dict[str, Callable[[Handshake, Handshake], bytes]] = {
    "garbage": lambda d, other: b"\xff" * HELLO.size,
    "wrong magic": lambda d, other: HELLO.pack(b"ARS0", d.link_id, 0, d.stripe_proof(True, 0)),
    "no proof": lambda d, other: hello(d, 0, b"\x00" * 32),
    "the listener's proof reflected": lambda d, other: hello(d, 0, d.stripe_proof(False, 0)),
    "another index's proof": lambda d, other: hello(d, 0, d.stripe_proof(True, 1)),
    "another connection's proof": lambda d, other: hello(d, 0, other.stripe_proof(True, 0)),
    "unknown link id": lambda d, other: hello(other, 0),
    "index out of range": lambda d, other: hello(d, 2),
    "index far out of range": lambda d, other: hello(d, 65535),
}


@pytest.mark.parametrize("name", sorted(BAD_GREETINGS))
async def test_a_bad_hello_is_refused_and_the_listener_goes_on(harness: Harness, name: str) -> None:
    listener = harness.listener(count=2)
    dialer, ours = established()
    other, _ = established()  # never expected by the listener
    end = harness.end(count=2, prove=ours.stripe_proof)
    listener.expect(ours.link_id, end.stripes)
    assert refused(greet(harness, listener, BAD_GREETINGS[name](dialer, other)))
    for index in range(2):
        side_connection(harness, listener, dialer, index)
    await ready(end)


async def test_a_truncated_hello_then_eof_is_refused(harness: Harness) -> None:
    listener = harness.listener(count=1)
    dialer, ours = established()
    end = harness.end(count=1, prove=ours.stripe_proof)
    listener.expect(ours.link_id, end.stripes)
    sock = greet(harness, listener, hello(dialer, 0)[:-5])
    sock.shutdown(socket.SHUT_WR)
    assert refused(sock)
    side_connection(harness, listener, dialer, 0)
    await ready(end)


async def test_a_silent_connection_is_refused_after_the_timeout(harness: Harness) -> None:
    listener = harness.listener(count=1, timeout=0.2)
    dialer, ours = established()
    end = harness.end(count=1, prove=ours.stripe_proof)
    listener.expect(ours.link_id, end.stripes)
    assert refused(greet(harness, listener, hello(dialer, 0)[:10]))
    side_connection(harness, listener, dialer, 0)
    await ready(end)


def spy_on_attach(stripes: Stripes, hold: threading.Event | None = None) -> queue.SimpleQueue[int]:
    """The indexes ``stripes`` attaches, as they are attached; with ``hold``, its first
    attach waits (bounded) for ``hold`` first, as a thread preempted before it would."""
    real, attached, calls = stripes.attach, queue.SimpleQueue[int](), itertools.count()

    def attach(index: int, sock: socket.socket) -> None:
        if hold is not None and next(calls) == 0:
            hold.wait(WAIT)
        real(index, sock)
        attached.put(index)

    stripes.attach = attach  # type: ignore[method-assign]
    return attached


async def test_the_same_index_twice_is_refused(harness: Harness) -> None:
    listener = harness.listener(count=2)
    dialer, ours = established()
    end = harness.end(count=2, prove=ours.stripe_proof)
    attached = spy_on_attach(end.stripes)
    listener.expect(ours.link_id, end.stripes)
    side_connection(harness, listener, dialer, 0)
    assert await asyncio.to_thread(attached.get, timeout=WAIT) == 0
    assert refused(greet(harness, listener, hello(dialer, 0)))
    side_connection(harness, listener, dialer, 1)
    await ready(end)


async def test_the_same_index_is_refused_while_the_first_is_being_attached(
    harness: Harness,
) -> None:
    """The listener ACKs a side connection, then attaches it: a second HELLO for its
    index in between must be refused too (one connection per index, each ACKed one
    used), not ACKed and then closed, or attached in the first one's place."""
    listener = harness.listener(count=2)
    dialer, ours = established()
    end = harness.end(count=2, prove=ours.stripe_proof)
    hold = threading.Event()
    attached = spy_on_attach(end.stripes, hold)
    listener.expect(ours.link_id, end.stripes)
    try:
        first = side_connection(harness, listener, dialer, 0)  # ACKed, not attached yet
        assert refused(greet(harness, listener, hello(dialer, 0)))
    finally:
        hold.set()
    assert await asyncio.to_thread(attached.get, timeout=WAIT) == 0
    second = side_connection(harness, listener, dialer, 1)
    await ready(end)
    first.sendall(HEADER.pack(KEY, 10, 0, 5) + b"01234")  # the first one is used
    second.sendall(HEADER.pack(KEY, 10, 5, 5) + b"56789")
    await arrived(end, KEY)


async def test_a_forgotten_link_is_refused(harness: Harness) -> None:
    listener = harness.listener(count=1)
    dialer, ours = established()
    end = harness.end(count=1, prove=ours.stripe_proof)
    listener.expect(ours.link_id, end.stripes)
    listener.forget(ours.link_id)
    assert refused(greet(harness, listener, hello(dialer, 0)))
    await asyncio.sleep(0)
    assert end.events.calls == []


@pytest.mark.parametrize("count", [0, MAX_STRIPES + 1])
def test_a_listener_count_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(ValueError, match="tcp_stripes"):
        StripeListener("127.0.0.1", count)


# -- dialing -----------------------------------------------------------------------------


async def test_dial_to_a_listener_then_buffers_both_ways(harness: Harness) -> None:
    listener = harness.listener(count=2)
    ours, theirs = established()
    near = harness.end(count=2, prove=ours.stripe_proof)
    far = harness.end(count=2, prove=theirs.stripe_proof)
    listener.expect(theirs.link_id, far.stripes)
    near.stripes.dial("127.0.0.1", listener.port, ours.link_id, timeout=WAIT)
    await ready(near, far)
    for sender, receiver, nbytes in ((near, far, 9 * MiB + 3), (far, near, 5 * MiB + 1)):
        await crosses(sender, receiver, nbytes)
        expected = nbytes + pieces(nbytes, 2) * HEADER.size
        assert sender.stripes.bytes_sent == receiver.stripes.bytes_received == expected
    assert near.events.named("failed") == far.events.named("failed") == []


async def test_a_dialer_without_the_proof_is_refused(harness: Harness) -> None:
    listener = harness.listener(count=2)
    ours, theirs = established()
    near = harness.end(count=2, prove=no_proof)
    far = harness.end(count=2, prove=theirs.stripe_proof)
    listener.expect(theirs.link_id, far.stripes)
    near.stripes.dial("127.0.0.1", listener.port, ours.link_id, timeout=WAIT)
    exc = await failure(near)
    assert isinstance(exc, ConnectionError)
    assert not near.stripes.ready and far.events.calls == []


async def fake_listener(answer: Callable[[bytes], bytes]) -> asyncio.Server:
    """A listener that reads a HELLO and answers ``answer(hello)``."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(await reader.readexactly(HELLO.size)))
        await writer.drain()
        writer.close()

    return await asyncio.start_server(greet, "127.0.0.1", 0)


@pytest.mark.parametrize(
    "answer",
    [
        lambda hello: ACK.pack(MAGIC, b"\x00" * 32),
        lambda hello: ACK.pack(MAGIC, HELLO.unpack(hello)[3]),  # the dialer's proof echoed
        lambda hello: ACK.pack(b"ARS0", b"\x00" * 32),
        lambda hello: b"",  # no ACK at all
    ],
    ids=["wrong proof", "reflected proof", "wrong magic", "hang up"],
)
async def test_a_listener_that_fails_its_proof_fails_the_dial(
    harness: Harness, answer: Callable[[bytes], bytes]
) -> None:
    ours, _ = established()
    near = harness.end(count=2, prove=ours.stripe_proof)
    server = await fake_listener(answer)
    async with server:
        port = server.sockets[0].getsockname()[1]
        near.stripes.dial("127.0.0.1", port, ours.link_id, timeout=WAIT)
        exc = await failure(near)
        assert isinstance(exc, ConnectionError)
        assert not near.stripes.ready
        await harness.threads_ended(near)


async def test_a_dial_to_nothing_fails(harness: Harness) -> None:
    ours, _ = established()
    near = harness.end(count=2, prove=ours.stripe_proof)
    with socket.socket() as bound:  # bound, not listening: the port refuses connections
        bound.bind(("127.0.0.1", 0))
        near.stripes.dial("127.0.0.1", bound.getsockname()[1], ours.link_id, timeout=WAIT)
        exc = await failure(near)
    assert isinstance(exc, ConnectionRefusedError)


async def test_a_listeners_end_is_ready_once_attached_and_confirmed(harness: Harness) -> None:
    """The listener's side sends nothing until the dialer's word (``confirm``), whichever
    of that and the last attach comes first; it still receives meanwhile."""
    for confirm_first in (False, True):
        end = harness.end(count=2, confirmed=False)
        if confirm_first:
            end.stripes.confirm()
            assert not end.stripes.ready and end.events.calls == []
        _, raws = harness.connect(end)
        raws[0].sendall(HEADER.pack(KEY, 10, 0, 5) + b"01234")
        raws[1].sendall(HEADER.pack(KEY, 10, 5, 5) + b"56789")
        await arrived(end, KEY)  # received before it may send
        if not confirm_first:
            assert not end.stripes.ready
            end.stripes.confirm()
        await ready(end)
        assert end.stripes.claim(KEY, 10)[1]


async def test_readers_start_with_the_side_connections_and_senders_with_the_first_send(
    harness: Harness,
) -> None:
    """A link that never sends a large buffer keeps one thread per side connection."""
    a, b = await harness.joined()

    def threads(end: End) -> int:
        return sum(1 for thread in threading.enumerate() if _of(thread, end.name))

    assert threads(a) == threads(b) == 2
    await crosses(a, b, 5 * MiB + 1)
    assert (threads(a), threads(b)) == (4, 2)
