"""Unit tests for Link over a fake transport: the handshake between two Links, frames
split anywhere, every protocol error closing the link once, write backpressure and
coalescing, read pausing and catch-up, messages queued behind shared-memory copies.

The fake transport records what the Link tells it and keeps the bytes written to it
until the test delivers them to the other end, as the peer's transport would: only
while that end reads.  Loop turns are real (``next_turn``); every wait is bounded in
turns, and the coalescing clock is the test's.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import pytest

from asyncrpc.errors import (
    HandshakeError,
    LocalProtocolError,
    PeerLostError,
    RemoteProtocolError,
)
from asyncrpc.transport.flow import COALESCE_WITHIN, FLUSH_PARTS
from asyncrpc.transport.link import FRAMES_PER_TURN, INLINE_COPY_MAX, Link
from asyncrpc.transport.liveness import DEFAULT_SILENT_PEER_TIMEOUT, silence_options
from asyncrpc.transport.shm import SHM_THRESHOLD, Segment, SegmentPool, fill_all
from asyncrpc.wire import (
    BATCHED_PAYLOAD_MAX,
    NEED_DATA,
    Allocator,
    ExternalRef,
    Frame,
    FrameDecoder,
    Handshake,
    Identity,
    Kind,
    Limits,
    Role,
    encode_batch,
    encode_entry,
    encode_frame,
)
from asyncrpc.wire.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    MAGIC,
    MAX_HANDSHAKE_FRAME,
    PRELUDE,
    allocate_bytearray,
)

SECRET = b"link-test-secret"
HOST_A = "boot=a,net=1,pid=1,uid=0"  # a Host's text (see asyncrpc.transport.locality)
HOST_B = "boot=b,net=1,pid=1,uid=0"  # another kernel
MiB = 1 << 20


class FakeTransport:
    """What a Link uses of ``asyncio.Transport``.  ``calls`` records what it was told
    (but writes), ``writes`` each ``writelines`` call's bytes, ``pending`` the bytes
    not delivered to the other end yet."""

    def __init__(self, protocol: Link) -> None:
        self.protocol = protocol
        self.calls: list[str] = []
        self.writes: list[bytes] = []
        self.pending = bytearray()
        self.reading = True
        self.closing = False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes) -> None:
        self.writelines([data])

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        assert not self.closing, "written after close"
        data = b"".join(bytes(part) for part in parts)
        self.writes.append(data)
        self.pending += data

    def pause_reading(self) -> None:
        self.calls.append("pause_reading")
        self.reading = False

    def resume_reading(self) -> None:
        self.calls.append("resume_reading")
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self._close("close")

    def abort(self) -> None:
        self._close("abort")

    def _close(self, how: str) -> None:
        self.calls.append(how)
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)


class Recorder:
    """The Link's owner: records what it is told (``about``: the link each report named)."""

    def __init__(self) -> None:
        self.established = 0
        self.frames: list[Frame] = []
        self.sent = 0
        self.lost: list[BaseException] = []
        self.about: list[Link] = []
        self.on_frame: Callable[[Link, Frame], None] = lambda link, frame: None

    def link_established(self, link: Link) -> None:
        self.about.append(link)
        self.established += 1

    def frame_received(self, link: Link, frame: Frame) -> None:
        self.about.append(link)
        self.frames.append(frame)
        self.on_frame(link, frame)

    def frames_sent(self, link: Link) -> None:
        self.about.append(link)
        self.sent += 1

    def link_lost(self, link: Link, exc: BaseException) -> None:
        self.about.append(link)
        self.lost.append(exc)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class End:
    """One end of a connection: the Link, its transport and its owner."""

    link: Link
    transport: FakeTransport
    owner: Recorder

    def send(self, i: int, payload: bytes = b"", buffers: tuple[memoryview, ...] = ()) -> None:
        self.link.send(Kind.NOTICE, {"i": i}, payload, buffers)

    def received(self) -> list[int]:
        return [frame.meta["i"] for frame in self.owner.frames]


def end(
    role: Role,
    name: str,
    *,
    host: str = HOST_A,
    secret: bytes = SECRET,
    segments: SegmentPool | None = None,
    clock: Callable[[], float] | None = None,
    handshake_timeout: float = 10.0,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    allocate: Allocator = allocate_bytearray,
    max_mapped_bytes: int | None = None,
    connect: bool = True,
) -> End:
    """A connected Link (``connection_made`` done: a dialer has written its HELLO,
    unless not ``connect``)."""
    owner = Recorder()
    identity = Identity(name, 0, os.getpid(), host)
    handshake = Handshake(role, secret, identity, max_frame_size=max_frame_size)
    extra: dict[str, Any] = {} if clock is None else {"clock": clock}
    if max_mapped_bytes is not None:
        extra["max_mapped_bytes"] = max_mapped_bytes
    link = Link(
        owner,
        handshake,
        allocate=allocate,
        segments=segments,
        handshake_timeout=handshake_timeout,
        **extra,
    )
    transport = FakeTransport(link)
    if connect:
        link.connection_made(transport)  # type: ignore[arg-type]
    return End(link, transport, owner)


def feed(to: End, data: bytes | bytearray | memoryview, chunk: int | None = None) -> int:
    """Hand bytes to a Link as its transport would, in chunks, while it reads; returns
    how many it took."""
    view = memoryview(data)
    taken = 0
    while taken < len(view) and to.transport.reading and not to.transport.closing:
        buffer = to.link.get_buffer(-1)
        n = min(len(buffer), len(view) - taken, chunk or len(view))
        buffer[:n] = view[taken : taken + n]
        to.link.buffer_updated(n)
        taken += n
    return taken


def deliver(source: End, to: End, chunk: int | None = None) -> int:
    """Move what ``source`` wrote to ``to``, as far as ``to`` reads."""
    taken = feed(to, bytes(source.transport.pending), chunk)
    del source.transport.pending[:taken]
    return taken


async def next_turn() -> None:
    """Let the loop run one iteration (callbacks scheduled with call_soon run)."""
    await asyncio.sleep(0)


async def exchange(
    a: End, b: End, until: Callable[[], bool], *, chunk: int | None = None, turns: int = 100
) -> None:
    """Deliver both ways, a loop turn at a time, until ``until()``: within ``turns``."""
    for _ in range(turns):
        deliver(a, b, chunk)
        deliver(b, a, chunk)
        if until():
            return
        await next_turn()
    raise AssertionError(f"not reached in {turns} loop turns")


async def connected(
    chunk: int | None = None, hosts: tuple[str, str] = (HOST_A, HOST_A), **options: Any
) -> tuple[End, End]:
    """A dialer and a listener (on ``hosts``), handshake done."""
    dialer = end(Role.DIALER, "dialer", host=hosts[0], **options)
    listener = end(Role.LISTENER, "listener", host=hosts[1], **options)
    await exchange(
        dialer,
        listener,
        lambda: dialer.link.ready.done() and listener.link.ready.done(),
        chunk=chunk,
    )
    return dialer, listener


async def settle(*ends: End, turns: int = 5) -> None:
    """A few loop turns, for what a test expects *not* to happen (e.g. a second report)."""
    for _ in range(turns):
        for a in ends:
            for b in ends:
                if a is not b:
                    deliver(a, b)
        await next_turn()


# -- the handshake and framing ---------------------------------------------------------


async def test_two_links_authenticate_each_other() -> None:
    dialer, listener = await connected()
    for this, other in ((dialer, listener), (listener, dialer)):
        assert this.link.ready.result() is this.link
        assert this.owner.established == 1
        assert this.link.peer == other.link.handshake.local
        assert this.owner.lost == [] and not this.link.closed
    await settle(dialer, listener)
    assert dialer.owner.established == listener.owner.established == 1


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100, None])
async def test_frames_split_anywhere_arrive_whole_and_in_order(chunk: int | None) -> None:
    """Chunks of one byte split every frame, the handshake's too, at every boundary."""
    dialer, listener = await connected(chunk)
    big = memoryview(bytes(range(256)) * 300)  # above the decoder's small-frame path
    messages: list[tuple[bytes, tuple[memoryview, ...]]] = [
        (b"", ()),
        (b"payload", ()),
        (b"p" * 70_000, (memoryview(b"inline buffer"), big)),
        (b"x", (memoryview(b""),)),
    ]
    for i, (payload, buffers) in enumerate(messages):
        dialer.send(i, payload, buffers)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 4, chunk=chunk)
    assert listener.received() == [0, 1, 2, 3]
    for frame, (payload, buffers) in zip(listener.owner.frames, messages, strict=True):
        assert frame.kind == Kind.NOTICE
        assert bytes(frame.payload) == payload
        assert [bytes(b) for b in frame.buffers] == [bytes(b) for b in buffers]
    assert dialer.owner.lost == listener.owner.lost == []


async def test_a_reply_goes_back_on_the_same_link() -> None:
    dialer, listener = await connected()
    listener.owner.on_frame = lambda link, frame: link.send(Kind.RESPONSE, {"i": frame.meta["i"]})
    dialer.link.send(Kind.REQUEST, {"i": 7})
    await exchange(dialer, listener, lambda: len(dialer.owner.frames) == 1)
    assert dialer.owner.frames[0].kind == Kind.RESPONSE and dialer.received() == [7]


async def test_every_report_to_the_owner_names_its_link() -> None:
    dialer, listener = await connected()
    dialer.send(1)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    listener.link.connection_lost(None)
    owner = listener.owner
    assert owner.established == len(owner.frames) == len(owner.lost) == 1 and owner.sent > 0
    assert len(owner.about) == 3 + owner.sent
    assert all(link is listener.link for link in owner.about)
    assert dialer.owner.about and all(link is dialer.link for link in dialer.owner.about)


async def test_a_link_is_named_by_its_role_and_its_peer_once_known() -> None:
    dialer = end(Role.DIALER, "dialer")
    listener = end(Role.LISTENER, "listener")
    assert (repr(dialer.link), repr(listener.link)) == (
        "<Link dialer peer=?>",
        "<Link listener peer=?>",
    )
    await exchange(
        dialer, listener, lambda: dialer.link.ready.done() and listener.link.ready.done()
    )
    assert (repr(dialer.link), repr(listener.link)) == (
        "<Link dialer peer=listener>",
        "<Link listener peer=dialer>",
    )


async def test_large_bodies_are_received_into_the_owners_storage() -> None:
    asked: list[int] = []

    def allocate(nbytes: int) -> tuple[Any, memoryview]:
        asked.append(nbytes)
        return allocate_bytearray(nbytes)

    dialer = end(Role.DIALER, "dialer")
    listener = end(Role.LISTENER, "listener", allocate=allocate)
    await exchange(
        dialer, listener, lambda: dialer.link.ready.done() and listener.link.ready.done()
    )
    big = memoryview(bytes(range(256)) * 1000)
    dialer.send(1, b"", (big,))
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(big)
    assert big.nbytes in asked


async def test_closing_says_whether_close_was_called_or_the_link_lost() -> None:
    dialer, listener = await connected()
    assert not dialer.link.closing and not listener.link.closing
    dialer.link.close()
    assert dialer.link.closing and not dialer.link.closed
    listener.link.connection_lost(None)
    assert listener.link.closing and listener.link.closed


# -- every protocol error closes the link, reported once with its cause ----------------


def prelude(header_len: int) -> bytes:
    return PRELUDE.pack(MAGIC, 0, header_len)


async def assert_dropped(
    this: End, error: type[BaseException], match: str, *others: End
) -> BaseException:
    """The link closed at once, told the transport to abort, and reported the cause
    exactly once (even after the transport's own ``connection_lost``)."""
    assert this.link.closed
    assert "abort" in this.transport.calls
    await settle(this, *others)
    assert len(this.owner.lost) == 1, this.owner.lost
    (cause,) = this.owner.lost
    assert isinstance(cause, error), cause
    assert match in str(cause)
    if not this.link.ready.done() or this.link.ready.exception() is not None:
        assert this.link.ready.exception() is cause
    return cause


HANDSHAKE_VIOLATIONS = {
    "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", RemoteProtocolError, "bad frame prelude"),
    "an oversized header": (prelude(10 << 20), RemoteProtocolError, "exceeds"),
    "a header above the handshake's frame": (
        prelude(MAX_HANDSHAKE_FRAME),
        RemoteProtocolError,
        "before the handshake completes",
    ),
    "a body before the handshake": (
        b"".join(encode_frame(Kind.HELLO, {}, b"x" * 100)),
        RemoteProtocolError,
        "exceeds the maximum frame size of 0 bytes before the handshake completes",
    ),
    "a REQUEST before the handshake": (
        b"".join(encode_frame(Kind.REQUEST, {"i": 1, "f": "os.system"})),
        RemoteProtocolError,
        "REQUEST frame not allowed before the handshake completes",
    ),
    "a handshake message out of turn": (
        b"".join(encode_frame(Kind.WELCOME, {})),
        HandshakeError,
        "",
    ),
}


@pytest.mark.parametrize("bad", list(HANDSHAKE_VIOLATIONS))
async def test_a_violation_before_the_handshake_drops_the_link(bad: str) -> None:
    data, error, match = HANDSHAKE_VIOLATIONS[bad]
    listener = end(Role.LISTENER, "listener")
    feed(listener, data, chunk=1)
    await assert_dropped(listener, error, match)
    assert listener.owner.frames == [] and listener.owner.established == 0
    assert listener.transport.writes == []  # not even a CHALLENGE


async def test_a_listener_with_another_secret_is_dropped_by_the_dialer() -> None:
    dialer = end(Role.DIALER, "dialer")
    listener = end(Role.LISTENER, "listener", secret=b"another secret")
    await exchange(dialer, listener, lambda: dialer.link.closed)
    await assert_dropped(dialer, HandshakeError, "", listener)
    assert dialer.owner.established == listener.owner.established == 0


async def test_a_message_above_the_peers_limit_fails_alone_and_the_link_stays() -> None:
    dialer = end(Role.DIALER, "dialer")
    listener = end(Role.LISTENER, "listener", max_frame_size=1000)
    await exchange(
        dialer, listener, lambda: dialer.link.ready.done() and listener.link.ready.done()
    )
    assert dialer.link.max_send_size == 1000
    writes = len(dialer.transport.writes)
    with pytest.raises(LocalProtocolError, match=r"call to f on worker 'listener'.*1000"):
        dialer.link.send(Kind.REQUEST, {"i": 1}, b"x" * 1001, function="f")
    with pytest.raises(LocalProtocolError, match="1001 bytes"):
        dialer.link.encode(Kind.REQUEST, {"i": 1}, b"", [memoryview(b"x" * 1001)])
    assert len(dialer.transport.writes) == writes  # nothing of it was written
    dialer.send(2, b"x" * 1000)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert listener.received() == [2] and not dialer.link.closed


TOO_LARGE = {
    Kind.REQUEST: "call to f on worker 'listener'",
    Kind.RESPONSE: "reply of f from worker 'dialer' to worker 'listener'",
    Kind.ERROR: "reply of f from worker 'dialer' to worker 'listener'",
    Kind.NOTICE: "NOTICE message to worker 'listener'",
}


@pytest.mark.parametrize("kind", list(TOO_LARGE))
async def test_too_large_a_message_is_refused_naming_its_call_the_workers_and_limits(
    kind: Kind,
) -> None:
    dialer = end(Role.DIALER, "dialer", max_frame_size=2000)
    listener = end(Role.LISTENER, "listener", max_frame_size=1000)
    await exchange(
        dialer, listener, lambda: dialer.link.ready.done() and listener.link.ready.done()
    )
    for refuse in (dialer.link.send, dialer.link.encode):
        with pytest.raises(LocalProtocolError) as raised:
            refuse(kind, {"i": 1}, b"x" * 1000, [memoryview(b"y")], function="f")
        assert str(raised.value) == (
            f"{TOO_LARGE[kind]} carries 1001 bytes, more than max_frame_size allows "
            "(worker 'listener' accepts 1000, worker 'dialer' accepts 2000 bytes)"
        )
        assert raised.value.details == {"nbytes": 1001, "worker": "listener", "function": "f"}


async def test_too_large_a_message_before_the_handshake_names_an_unknown_peer() -> None:
    dialer = end(Role.DIALER, "dialer", max_frame_size=10)
    with pytest.raises(LocalProtocolError) as raised:
        dialer.link.send(Kind.NOTICE, {}, b"x" * 11)
    assert str(raised.value) == (
        "NOTICE message to worker '?' carries 11 bytes, more than max_frame_size allows "
        "(worker 'dialer' accepts 10 bytes)"
    )
    assert raised.value.details == {"nbytes": 11, "worker": "?", "function": "?"}


async def test_a_call_without_a_function_name_is_refused_as_a_call_to_question_mark() -> None:
    dialer = end(Role.DIALER, "dialer")
    listener = end(Role.LISTENER, "listener", max_frame_size=10)
    await exchange(
        dialer, listener, lambda: dialer.link.ready.done() and listener.link.ready.done()
    )
    for refuse in (dialer.link.send, dialer.link.encode):
        with pytest.raises(LocalProtocolError, match=r"^call to \? on worker 'listener' "):
            refuse(Kind.REQUEST, {"i": 1}, b"x" * 11)


ESTABLISHED_VIOLATIONS = {
    "garbage": (b"\x00" * 64, RemoteProtocolError, "bad frame prelude"),
    "a handshake message again": (
        b"".join(encode_frame(Kind.HELLO, {})),
        RemoteProtocolError,
        "HELLO frame not allowed after the handshake",
    ),
    "a frame above max_frame_size": (
        b"".join(
            encode_frame(Kind.NOTICE, {}, b"", [ExternalRef(1, 9 << 30)], max_frame_size=1 << 40)
        ),
        RemoteProtocolError,
        "exceeds the maximum frame size",
    ),
    "an unknown kind": (
        prelude(4) + b"\x94\x63\x80\x00",  # msgpack [99, {}, 0, ...] (truncated on purpose)
        RemoteProtocolError,
        "",
    ),
    "a malformed BATCH frame": (
        b"".join(encode_frame(Kind.BATCH, {}, b"\xc1")),
        RemoteProtocolError,
        "undecodable BATCH frame",
    ),
    "a BATCH frame carrying a handshake message": (
        encode_batch([encode_entry(Kind.HELLO, {})]),
        RemoteProtocolError,
        "kind 1 not allowed in a BATCH frame",
    ),
    "malformed segment keys": (
        b"".join(encode_frame(Kind.UNMAP, {"k": ["not", "keys"]})),
        RemoteProtocolError,
        "malformed segment keys",
    ),
    "a shared-memory buffer from another host": (
        b"".join(encode_frame(Kind.NOTICE, {"i": 9}, b"", [ExternalRef(1 << 32 | 5, 4096)])),
        RemoteProtocolError,
        "another host",
    ),
}


@pytest.mark.parametrize("bad", list(ESTABLISHED_VIOLATIONS))
async def test_a_bad_frame_after_the_handshake_drops_the_link(bad: str) -> None:
    data, error, match = ESTABLISHED_VIOLATIONS[bad]
    dialer, listener = await connected(hosts=(HOST_A, HOST_B))
    dialer.send(1)
    valid = bytes(dialer.transport.pending)
    dialer.transport.pending.clear()
    feed(listener, valid + data + b"".join(encode_frame(Kind.NOTICE, {"i": 2})))
    await assert_dropped(listener, error, match, dialer)
    assert listener.received() == [1]  # what came before the bad frame, nothing after
    assert listener.owner.established == 1


async def test_an_owner_that_raises_drops_the_link_with_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dialer, listener = await connected()

    def fail(link: Link, frame: Frame) -> None:
        raise ValueError("owner bug")

    listener.owner.on_frame = fail
    dialer.send(1)
    dialer.send(2)
    await exchange(dialer, listener, lambda: listener.link.closed)
    await assert_dropped(listener, ValueError, "owner bug", dialer)
    assert listener.received() == [1]
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == (
        "internal error handling a frame on <Link listener peer=dialer>; dropping the link"
    )
    assert record.exc_info is not None and record.exc_info[1] is listener.owner.lost[0]


async def test_a_dropped_connection_is_logged_with_the_link_and_the_violation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listener = end(Role.LISTENER, "listener")
    feed(listener, b"".join(encode_frame(Kind.REQUEST, {"i": 1})))
    cause = await assert_dropped(listener, RemoteProtocolError, "REQUEST frame not allowed")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"dropping connection <Link listener peer=?>: {cause}"
    ]


@pytest.mark.parametrize("kind", [Kind.RELEASE, Kind.UNMAP])
async def test_segment_bookkeeping_without_keys_is_a_no_op_and_the_link_stays(
    kind: Kind, pool: HeldCopies
) -> None:
    dialer, listener = await connected(segments=pool)
    feed(listener, b"".join(encode_frame(kind, {})))
    dialer.send(1)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert not listener.link.closed and listener.owner.lost == []


async def test_end_of_stream_is_a_lost_peer_reported_once() -> None:
    _dialer, listener = await connected()
    assert listener.link.eof_received() is False
    cause = await assert_dropped(listener, PeerLostError, "worker 'dialer': closed the connection")
    assert cause.details == {"worker": "dialer"}


async def test_connection_lost_is_reported_once_with_its_cause() -> None:
    _dialer, listener = await connected()
    cause = ConnectionResetError("reset by peer")
    listener.link.connection_lost(cause)
    listener.link.connection_lost(None)
    assert listener.link.closed and len(listener.owner.lost) == 1
    (error,) = listener.owner.lost
    assert isinstance(error, PeerLostError) and error.__cause__ is cause
    assert str(error) == "worker 'dialer': connection lost (reset by peer)"
    assert error.details == {"worker": "dialer"}


@pytest.mark.parametrize(
    "cause",
    [
        TimeoutError(errno.ETIMEDOUT, "Connection timed out"),
        OSError(errno.EHOSTUNREACH, "No route to host"),  # timed out, after an ICMP error
    ],
)
async def test_a_connection_the_kernel_timed_out_is_a_silent_peer(cause: OSError) -> None:
    """No acknowledgement or keepalive answer for ``silence_timeout``."""
    _dialer, listener = await connected()
    listener.link.connection_lost(cause)
    (error,) = listener.owner.lost
    assert isinstance(error, PeerLostError) and error.__cause__ is cause
    assert str(error) == (
        "worker 'dialer': silent for 30s (silent_peer_timeout): no answer to our bytes or "
        f"keepalive probes ({cause.strerror}); a network partition, or its host is down"
    )


async def test_a_connection_lost_without_a_cause_or_before_the_handshake_says_so() -> None:
    listener = end(Role.LISTENER, "listener")
    listener.link.connection_lost(None)
    (error,) = listener.owner.lost
    assert isinstance(error, PeerLostError) and error.__cause__ is None
    assert str(error) == "before the handshake: connection lost (closed)"
    assert error.details == {}
    assert listener.link.ready.exception() is error


async def test_a_handshake_that_never_completes_times_out() -> None:
    listener = end(Role.LISTENER, "listener", handshake_timeout=0.01)
    with pytest.raises(HandshakeError, match="not completed in time"):
        await asyncio.wait_for(asyncio.shield(listener.link.ready), 5)
    cause = await assert_dropped(listener, HandshakeError, "not completed in time")
    assert str(cause) == "<Link listener peer=?>: handshake not completed in time"
    assert cause.details == {"timed_out": True}


async def test_a_link_whose_connection_never_came_times_out_alone() -> None:
    listener = end(Role.LISTENER, "listener", handshake_timeout=0.01, connect=False)
    listener.link.close()  # nothing to close yet
    assert listener.link.closing and not listener.link.closed
    with pytest.raises(HandshakeError, match="not completed in time"):
        await asyncio.wait_for(asyncio.shield(listener.link.ready), 5)
    assert listener.link.closed and len(listener.owner.lost) == 1
    assert listener.transport.calls == []  # it never had one to abort


async def test_nothing_is_handed_up_or_written_after_the_link_is_lost() -> None:
    dialer, listener = await connected()
    dialer.send(1)
    pending = bytes(dialer.transport.pending)
    listener.link.connection_lost(None)
    feed(listener, pending)  # a read racing the loss
    await settle(listener)
    assert listener.owner.frames == []
    writes = len(listener.transport.writes)
    listener.link.send(Kind.NOTICE, {"i": 3})
    await settle(listener)
    assert len(listener.transport.writes) == writes and len(listener.owner.lost) == 1


# -- writing: backpressure and coalescing ----------------------------------------------


async def test_backpressure_holds_writes_and_resuming_writes_them_in_order() -> None:
    dialer, listener = await connected()
    writes = len(dialer.transport.writes)
    dialer.link.pause_writing()
    for i in range(FLUSH_PARTS + 3):  # past the burst limit: paused still holds them
        dialer.send(i)
    await settle(dialer)  # the turn ends: nothing leaves while paused
    assert len(dialer.transport.writes) == writes
    dialer.link.resume_writing()
    assert len(dialer.transport.writes) == writes + 1  # all of it, in one writelines
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == FLUSH_PARTS + 3)
    assert listener.received() == list(range(FLUSH_PARTS + 3))
    dialer.send(99)
    assert len(dialer.transport.writes) == writes + 2  # resumed: leaves at once


async def test_close_while_paused_still_writes_what_waits() -> None:
    dialer, listener = await connected()
    dialer.link.pause_writing()
    dialer.send(1)
    dialer.send(2)
    dialer.link.close()
    assert dialer.transport.calls[-1] == "close"
    feed(listener, dialer.transport.pending)
    await next_turn()
    assert listener.received() == [1, 2]


async def quiet_pair(**options: Any) -> tuple[Clock, End, End, int]:
    """A connected pair on a clock the test moves, settled; and how many writes the
    dialer has made so far."""
    clock = Clock()
    dialer, listener = await connected(clock=clock, **options)
    await settle(dialer, listener)
    return clock, dialer, listener, len(dialer.transport.writes)


async def test_a_burst_in_one_turn_leaves_at_the_end_of_the_turn_in_one_write() -> None:
    clock, dialer, listener, writes = await quiet_pair()
    dialer.send(1)  # the first of the turn: at once
    assert len(dialer.transport.writes) == writes + 1
    clock.now += COALESCE_WITHIN / 2
    dialer.send(2)
    clock.now += COALESCE_WITHIN / 2
    dialer.send(3)
    assert len(dialer.transport.writes) == writes + 1  # a burst: waits for the turn's end
    await next_turn()
    assert len(dialer.transport.writes) == writes + 2
    assert one_frame(dialer.transport.writes[-1]).kind == Kind.BATCH  # 2 and 3, small
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 3)
    assert listener.received() == [1, 2, 3]
    assert {frame.kind for frame in listener.owner.frames} == {Kind.NOTICE}


def kinds_written(source: End, since: int) -> list[str]:
    """The kinds of the frames ``source`` wrote from its ``since``-th write on."""
    decoder = FrameDecoder(Limits.established(DEFAULT_MAX_FRAME_SIZE))
    decoder.receive_data(b"".join(source.transport.writes[since:]))
    kinds = []
    while isinstance(frame := decoder.next_event(), Frame):
        kinds.append(Kind(frame.kind).name)
    return kinds


def one_frame(data: bytes) -> Frame:
    decoder = FrameDecoder(Limits.established(DEFAULT_MAX_FRAME_SIZE))
    decoder.receive_data(data)
    frame = decoder.next_event()
    assert isinstance(frame, Frame) and decoder.next_event() is NEED_DATA
    return frame


async def test_a_bursts_messages_with_buffers_or_large_payloads_keep_frames_of_their_own() -> None:
    _clock, dialer, listener, writes = await quiet_pair()
    dialer.send(1)
    dialer.send(2, b"p" * BATCHED_PAYLOAD_MAX)  # small enough: an entry
    dialer.send(3, b"p" * (BATCHED_PAYLOAD_MAX + 1))
    dialer.send(4, b"", (memoryview(b"buffer"),))
    dialer.send(5)
    await next_turn()
    assert kinds_written(dialer, writes) == ["NOTICE", "BATCH", "NOTICE", "NOTICE", "BATCH"]
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 5)
    assert listener.received() == [1, 2, 3, 4, 5]
    assert [len(f.payload) for f in listener.owner.frames][1:3] == [
        BATCHED_PAYLOAD_MAX,
        BATCHED_PAYLOAD_MAX + 1,
    ]
    assert bytes(listener.owner.frames[3].buffers[0]) == b"buffer"


async def test_a_message_after_a_pause_in_the_turn_leaves_at_once() -> None:
    clock, dialer, listener, writes = await quiet_pair()
    dialer.send(1)
    clock.now += COALESCE_WITHIN / 2
    dialer.send(2)  # held
    clock.now += COALESCE_WITHIN * 2
    dialer.send(3)  # computed a while since: leaves, taking 2 along first
    assert len(dialer.transport.writes) == writes + 2
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 3)
    assert listener.received() == [1, 2, 3]


async def test_the_first_message_of_a_later_turn_leaves_at_once() -> None:
    # The clock stands still: only the turn's end separates the two.
    _clock, dialer, listener, writes = await quiet_pair()
    dialer.send(1)
    await next_turn()
    dialer.send(2)
    assert len(dialer.transport.writes) == writes + 2
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 2)
    assert listener.received() == [1, 2]


async def test_every_message_sent_is_counted_for_the_owner() -> None:
    dialer, _listener = await connected()
    sent = dialer.owner.sent
    for i in range(3):
        dialer.send(i)
    assert dialer.owner.sent == sent + 3


# -- reading: the owner's pause, catch-up ----------------------------------------------


def frames(numbers: range) -> bytes:
    return b"".join(b"".join(encode_frame(Kind.NOTICE, {"i": i})) for i in numbers)


async def test_a_burst_is_handed_up_a_few_frames_per_turn_without_reading_meanwhile() -> None:
    _dialer, listener = await connected()
    count = FRAMES_PER_TURN * 3 + 5
    listener.transport.calls.clear()
    assert feed(listener, frames(range(count))) > 0
    assert listener.received() == list(range(FRAMES_PER_TURN))  # one slice this turn
    assert listener.transport.calls == ["pause_reading"]  # staged frames wait: read no more
    assert feed(listener, frames(range(count, count + 1))) == 0
    for turn in range(2, 4):
        await next_turn()
        assert listener.received() == list(range(FRAMES_PER_TURN * turn))
        assert listener.transport.calls == ["pause_reading"]
    await next_turn()
    assert listener.received() == list(range(count))
    assert listener.transport.calls == ["pause_reading", "resume_reading"]  # caught up
    assert feed(listener, frames(range(count, count + 1))) > 0
    assert listener.received() == list(range(count + 1))


async def test_the_owner_pauses_reading_and_frames_wait_until_it_resumes() -> None:
    _dialer, listener = await connected()
    listener.transport.calls.clear()
    listener.owner.on_frame = lambda link, frame: frame.meta["i"] == 1 and link.pause_reading()
    feed(listener, frames(range(5)))
    assert listener.received() == [0, 1]
    assert listener.transport.calls == ["pause_reading"]
    await settle(listener)
    assert listener.received() == [0, 1]  # held, however many turns pass
    listener.owner.on_frame = lambda link, frame: None
    listener.link.resume_reading()
    assert listener.transport.calls == ["pause_reading", "resume_reading"]
    await next_turn()
    assert listener.received() == [0, 1, 2, 3, 4]


async def test_batches_fit_the_peers_frame_limit_and_a_message_too_large_for_one_goes_alone() -> (
    None
):
    _clock, dialer, listener, writes = await quiet_pair(max_frame_size=2500)
    dialer.send(0)
    for i in range(1, 8):
        dialer.send(i, b"p" * 1000)
    dialer.link.send(Kind.NOTICE, {"i": 8, "long": "m" * 3000}, b"")  # fits no batch
    dialer.send(9)
    await next_turn()
    expected = ["NOTICE", "BATCH", "BATCH", "BATCH", "BATCH", "NOTICE", "BATCH"]
    assert kinds_written(dialer, writes) == expected
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 10)
    assert listener.received() == list(range(10))
    assert listener.owner.lost == []


def batch(numbers: range) -> bytes:
    return encode_batch([encode_entry(Kind.NOTICE, {"i": i}) for i in numbers])


async def test_the_messages_of_a_batch_frame_wait_for_the_owners_pause_too() -> None:
    _dialer, listener = await connected()
    listener.owner.on_frame = lambda link, frame: frame.meta["i"] == 1 and link.pause_reading()
    feed(listener, batch(range(4)) + frames(range(4, 6)))
    assert listener.received() == [0, 1]
    await settle(listener)
    assert listener.received() == [0, 1]  # the rest of the batch waits, then the frames
    listener.owner.on_frame = lambda link, frame: None
    listener.link.resume_reading()
    await next_turn()
    assert listener.received() == [0, 1, 2, 3, 4, 5]


async def test_a_batch_frame_is_handed_up_a_few_messages_per_turn() -> None:
    _dialer, listener = await connected()
    feed(listener, batch(range(FRAMES_PER_TURN + 5)))
    assert len(listener.received()) == FRAMES_PER_TURN - 1  # (the BATCH frame took a go)
    await next_turn()
    assert listener.received() == list(range(FRAMES_PER_TURN + 5))


async def test_the_owner_pause_outlasts_catching_up() -> None:
    _dialer, listener = await connected()
    listener.transport.calls.clear()
    feed(listener, frames(range(FRAMES_PER_TURN + 1)))  # one frame left for the next turn
    listener.link.pause_reading()
    await settle(listener)
    assert listener.received() == list(range(FRAMES_PER_TURN))
    assert listener.transport.calls == ["pause_reading"]  # told once, for both reasons
    listener.link.resume_reading()
    await next_turn()
    assert listener.received() == list(range(FRAMES_PER_TURN + 1))
    assert listener.transport.calls == ["pause_reading", "resume_reading"]


async def test_resuming_after_catch_up_does_not_tell_the_transport_twice() -> None:
    _dialer, listener = await connected()
    listener.transport.calls.clear()
    listener.link.pause_reading()
    listener.link.resume_reading()
    listener.link.resume_reading()
    await settle(listener)
    assert listener.transport.calls == ["pause_reading", "resume_reading"]


# -- over real sockets ------------------------------------------------------------------


SocketEnd = tuple[Link, Recorder, asyncio.Transport]


async def handshake_over(a: socket.socket, b: socket.socket) -> list[SocketEnd]:
    """Two Links on a connected socket pair, handshake done; each with its owner and
    the event loop's transport."""
    loop = asyncio.get_running_loop()
    ends: list[SocketEnd] = []
    for sock, role, name in ((a, Role.DIALER, "dialer"), (b, Role.LISTENER, "listener")):
        owner = Recorder()
        handshake = Handshake(role, SECRET, Identity(name, 0, os.getpid(), HOST_A))
        transport, link = await loop.connect_accepted_socket(
            lambda: Link(owner, handshake, allocate=allocate_bytearray),
            sock,
        )
        ends.append((link, owner, cast(asyncio.Transport, transport)))
    await asyncio.wait_for(asyncio.gather(*(link.ready for link, _, _ in ends)), 5)
    return ends


async def send_one_and_close(ends: list[SocketEnd]) -> None:
    """A message one way, then both closed (each reports its loss)."""
    (dialer, _, _), (_, listener_owner, _) = ends
    dialer.send(Kind.NOTICE, {"i": 1}, b"over a socket")
    for _ in range(100):
        if listener_owner.frames:
            break
        await asyncio.sleep(0.01)
    assert bytes(listener_owner.frames[0].payload) == b"over a socket"
    for link, _, _ in ends:
        link.close()
    for _ in range(100):
        if all(owner.lost for _, owner, _ in ends):
            return
        await next_turn()
    raise AssertionError("not closed in 100 loop turns")


async def test_a_tcp_link_turns_nagle_off_buffers_up_to_4_mib_and_detects_silence() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    ends = await handshake_over(client, accepted)
    for _, _, transport in ends:
        sock = transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert transport.get_write_buffer_limits() == (1 << 20, 4 << 20)
        for level, option, value in silence_options(DEFAULT_SILENT_PEER_TIMEOUT):
            assert sock.getsockopt(level, option) == value  # a silent peer is dropped
    await send_one_and_close(ends)


async def test_a_link_over_a_unix_socket_sets_no_tcp_option() -> None:
    ends = await handshake_over(*socket.socketpair(socket.AF_UNIX))
    await send_one_and_close(ends)


# -- messages behind shared-memory copies ----------------------------------------------


class HeldCopies(SegmentPool):
    """A segment pool whose copies wait for the test (``finish``, ``cancel``); while
    ``refuse`` is set, its copiers take no job (``fill_later`` raises it)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.held: list[tuple[list[tuple[Segment, memoryview]], Future[None]]] = []
        self.refuse: BaseException | None = None

    def fill_later(self, fills: list[tuple[Segment, memoryview]]) -> Future[None]:
        if self.refuse is not None:
            raise self.refuse
        job: Future[None] = Future()
        self.held.append((fills, job))
        return job

    def finish(self, index: int, error: BaseException | None = None) -> None:
        fills, job = self.held[index]
        if error is None:
            fill_all(fills)
            job.set_result(None)
        else:
            job.set_exception(error)

    def cancel(self, index: int) -> None:
        assert self.held[index][1].cancel()


@pytest.fixture
def pool() -> Iterator[HeldCopies]:
    pool = HeldCopies()
    yield pool
    pool.close()


shared_memory = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"),
    reason="shared-memory segments need Linux memfd and /proc",
)


def large(seed: int) -> memoryview:
    return memoryview(bytes([seed]) * SHM_THRESHOLD)


@shared_memory
async def test_messages_behind_a_shared_memory_copy_leave_in_order(pool: HeldCopies) -> None:
    dialer, listener = await connected(segments=pool)
    writes = len(dialer.transport.writes)
    dialer.send(1, b"", (large(1),))
    dialer.send(2)
    dialer.send(3, b"", (large(3),))
    dialer.send(4)
    assert len(pool.held) == 2
    assert len(dialer.transport.writes) == writes  # all wait for the first copy
    pool.finish(1)  # the later copy first: still nothing may leave
    await settle(dialer, listener)
    assert listener.received() == []
    pool.finish(0)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 4)
    assert listener.received() == [1, 2, 3, 4]
    first, _, third, _ = listener.owner.frames
    assert bytes(first.buffers[0]) == bytes(large(1))  # through the segment, not inline
    assert bytes(third.buffers[0]) == bytes(large(3))
    assert sum(len(w) for w in dialer.transport.writes[writes:]) < SHM_THRESHOLD


@shared_memory
@pytest.mark.parametrize(
    ("ending", "error"),
    [
        (lambda pool: pool.finish(0, OSError("copy failed")), "OSError('copy failed')"),
        (lambda pool: pool.cancel(0), "CancelledError()"),
    ],
    ids=["failed", "cancelled"],
)
async def test_a_copy_that_does_not_finish_sends_its_message_inline_in_its_place(
    pool: HeldCopies,
    caplog: pytest.LogCaptureFixture,
    ending: Callable[[HeldCopies], None],
    error: str,
) -> None:
    dialer, listener = await connected(segments=pool)
    dialer.send(1, b"", (large(1),))
    dialer.send(2)
    ending(pool)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 2)
    assert listener.received() == [1, 2]
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(large(1))
    assert listener.owner.lost == []
    assert_fell_back(pool, caplog, error)


def assert_fell_back(pool: SegmentPool, caplog: pytest.LogCaptureFixture, error: str) -> None:
    """One segment's copy failed: the segment is closed (not reused), the fallback
    counted and logged with the link and the error."""
    stats = pool.stats
    assert (stats["segments_in_use"], stats["segments_idle"]) == (0, 0)
    assert (stats["fallbacks"], stats["fallback_bytes"]) == (1, SHM_THRESHOLD)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"<Link dialer peer=listener>: copy into shared memory failed ({error}); using the socket"
    ]


async def delivered_through_segment(sender: End, receiver: End, pool: HeldCopies) -> None:
    """``sender`` sends message 1 with a large buffer; its copy into a segment
    finishes, and ``receiver`` has the message (and a view of the segment)."""
    sender.send(1, b"", (large(1),))
    pool.finish(len(pool.held) - 1)
    await exchange(sender, receiver, lambda: len(receiver.owner.frames) == 1)


async def warm_segment(dialer: End, listener: End, pool: HeldCopies, nbytes: int) -> None:
    """Send ``nbytes`` through a segment and let the receiver drop them: the segment
    is idle again, its pages faulted in."""
    dialer.send(0, b"", (memoryview(bytes(nbytes)),))
    pool.finish(len(pool.held) - 1)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    listener.owner.frames.clear()
    await exchange(dialer, listener, lambda: pool.stats["segments_idle"] == 1)


@shared_memory
async def test_a_copy_of_up_to_4_mib_into_a_warm_segment_happens_on_the_loop(
    pool: HeldCopies,
) -> None:
    dialer, listener = await connected(segments=pool)
    await warm_segment(dialer, listener, pool, INLINE_COPY_MAX)
    writes = len(dialer.transport.writes)
    data = memoryview(bytes([5]) * INLINE_COPY_MAX)
    dialer.send(1, b"", (data,))
    assert len(pool.held) == 1  # no copier thread: copied at once, on the loop
    assert pool.stats["segments_in_use"] == 1
    assert len(dialer.transport.writes) == writes  # written in the next loop turn
    await asyncio.sleep(0)
    assert len(dialer.transport.writes) == writes + 1
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(data)
    assert sum(len(w) for w in dialer.transport.writes[writes:]) < SHM_THRESHOLD


@shared_memory
async def test_a_copy_above_4_mib_or_into_a_cold_segment_goes_to_a_copier(
    pool: HeldCopies,
) -> None:
    dialer, listener = await connected(segments=pool)
    await warm_segment(dialer, listener, pool, INLINE_COPY_MAX)
    dialer.send(1, b"", (memoryview(bytes(INLINE_COPY_MAX + 1)),))  # above: a new segment
    assert len(pool.held) == 2
    dialer.send(2, b"", (memoryview(bytes(INLINE_COPY_MAX)),))  # the warm one
    assert len(pool.held) == 2  # copied on the loop, but waits its turn
    pool.finish(1)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 2)
    assert listener.received() == [1, 2]


@shared_memory
async def test_a_copy_that_fails_on_the_loop_sends_its_message_inline(
    pool: HeldCopies, caplog: pytest.LogCaptureFixture
) -> None:
    dialer, listener = await connected(segments=pool)
    await warm_segment(dialer, listener, pool, SHM_THRESHOLD)
    caplog.clear()
    # every other byte: a view the copy cannot read (not C-contiguous)
    strided = memoryview(bytearray(bytes(range(256)) * (SHM_THRESHOLD // 128)))[::2]
    assert strided.nbytes == SHM_THRESHOLD and not strided.contiguous
    dialer.send(1, b"", (strided,))
    assert len(pool.held) == 1  # tried on the loop (a warm segment)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(strided)
    assert_fell_back(pool, caplog, "TypeError('underlying buffer is not C contiguous')")


@shared_memory
async def test_a_buffer_the_budget_has_no_room_for_goes_inline_at_once() -> None:
    pool = HeldCopies(budget=SHM_THRESHOLD)
    try:
        dialer, listener = await connected(segments=pool)
        dialer.send(1, b"", (large(1),))  # the budget's only segment, filling
        dialer.send(2, b"", (large(2),))  # no room left: inline, behind the first
        assert len(pool.held) == 1 and pool.stats["fallbacks"] == 1
        pool.finish(0)
        await exchange(dialer, listener, lambda: len(listener.owner.frames) == 2)
        assert [bytes(f.buffers[0]) for f in listener.owner.frames] == [
            bytes(large(1)),
            bytes(large(2)),
        ]
        writes = len(dialer.transport.writes)
        dialer.send(3, b"", (large(3),))  # nothing queued: leaves at once
        assert len(dialer.transport.writes) == writes + 1
        assert sum(len(w) for w in dialer.transport.writes[writes:]) > SHM_THRESHOLD
    finally:
        pool.close()


@shared_memory
async def test_only_buffers_of_the_threshold_or_more_go_through_segments(
    pool: HeldCopies,
) -> None:
    dialer, listener = await connected(segments=pool)
    small = memoryview(bytes(SHM_THRESHOLD - 1))
    dialer.send(1, b"", (small, large(1), small))
    assert pool.stats["segments_in_use"] == 1
    pool.finish(0)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    received = [bytes(b) for b in listener.owner.frames[0].buffers]
    assert received == [bytes(small), bytes(large(1)), bytes(small)]


@shared_memory
async def test_a_message_that_cannot_be_encoded_gives_its_segments_back(
    pool: HeldCopies,
) -> None:
    dialer, _listener = await connected(segments=pool)
    for refuse in (dialer.link.send, dialer.link.encode):
        with pytest.raises(TypeError):
            refuse(Kind.NOTICE, {"i": object()}, b"", [large(1), large(2)])
        assert pool.stats["segments_in_use"] == 0
    assert pool.held == [] and not dialer.link.closed


@shared_memory
async def test_a_copy_the_copiers_refuse_fails_the_send_and_gives_its_segment_back(
    pool: HeldCopies,
) -> None:
    dialer, listener = await connected(segments=pool)
    pool.refuse = RuntimeError("copiers shut down")
    with pytest.raises(RuntimeError, match="copiers shut down"):
        dialer.send(1, b"", (large(1),))
    assert pool.stats["segments_in_use"] == 0
    pool.refuse = None
    dialer.send(2)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert listener.received() == [2]


@shared_memory
async def test_a_lost_link_closes_the_segments_its_peer_still_uses(pool: HeldCopies) -> None:
    dialer, listener = await connected(segments=pool)
    await delivered_through_segment(dialer, listener, pool)
    assert pool.stats["segments_in_use"] == 1
    dialer.link.connection_lost(None)
    assert (pool.stats["segments_in_use"], pool.stats["segments_idle"]) == (0, 0)


@shared_memory
async def test_segments_the_sender_closes_are_unmapped_by_the_receiver() -> None:
    pool = HeldCopies(max_idle_bytes=0, idle_grace=0.0)  # idle segments close, but the newest
    try:
        dialer, listener = await connected(segments=pool)
        dialer.send(1, b"", (large(1),))
        dialer.send(2, b"", (large(2),))
        pool.finish(0)
        pool.finish(1)
        await exchange(dialer, listener, lambda: len(listener.owner.frames) == 2)
        assert listener.link.mapped_bytes == 2 * SHM_THRESHOLD
        listener.owner.frames.clear()  # both released: the older one closes (UNMAP)
        await exchange(dialer, listener, lambda: listener.link.mapped_bytes == SHM_THRESHOLD)
        assert pool.stats["segments_idle"] == 1
        assert not listener.link.closed and not dialer.link.closed
    finally:
        pool.close()


@shared_memory
async def test_the_receiver_keeps_at_most_max_mapped_bytes_of_mappings(pool: HeldCopies) -> None:
    dialer = end(Role.DIALER, "dialer", segments=pool)
    listener = end(Role.LISTENER, "listener", segments=pool, max_mapped_bytes=SHM_THRESHOLD)
    await exchange(
        dialer, listener, lambda: dialer.link.ready.done() and listener.link.ready.done()
    )
    for i in range(3):
        dialer.send(i, b"", (large(i),))
        pool.finish(i)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 3)
    assert listener.link.mapped_bytes == SHM_THRESHOLD  # the newest only
    assert [bytes(f.buffers[0]) for f in listener.owner.frames] == [
        bytes(large(i)) for i in range(3)
    ]


def test_a_segment_released_after_the_loop_closed_is_not_an_error() -> None:
    """A tensor on a peer's segment may outlive the worker's event loop."""

    async def make() -> End:
        return end(Role.DIALER, "dialer")

    loop = asyncio.new_event_loop()
    dialer = loop.run_until_complete(make())
    loop.close()
    dialer.link.segment_released(1)
    dialer.link.segments_closed([2, 3])


@shared_memory
async def test_close_waits_for_queued_messages(pool: HeldCopies) -> None:
    dialer, listener = await connected(segments=pool)
    dialer.send(1, b"", (large(1),))
    dialer.send(2)
    dialer.link.close()
    assert "close" not in dialer.transport.calls
    pool.finish(0)
    await exchange(dialer, listener, lambda: "close" in dialer.transport.calls)
    feed(listener, dialer.transport.pending)
    assert listener.received() == [1, 2]


@shared_memory
async def test_close_waits_for_a_message_copied_on_the_loop(pool: HeldCopies) -> None:
    """A warm copy leaves in the next loop turn: a close in this one still sends it,
    and what follows it, first."""
    dialer, listener = await connected(segments=pool)
    await warm_segment(dialer, listener, pool, SHM_THRESHOLD)
    dialer.send(1, b"", (large(1),))  # copied here, written next turn
    assert len(pool.held) == 1  # (warm_segment's): no copier thread for this one
    dialer.send(2)
    dialer.link.close()
    assert "close" not in dialer.transport.calls
    await exchange(dialer, listener, lambda: "close" in dialer.transport.calls)
    feed(listener, dialer.transport.pending)
    assert listener.received() == [1, 2]
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(large(1))


@shared_memory
async def test_a_segment_the_receiver_lets_go_of_goes_back_to_the_pool(pool: HeldCopies) -> None:
    dialer, listener = await connected(segments=pool)
    await delivered_through_segment(dialer, listener, pool)
    assert pool.stats["segments_in_use"] == 1
    listener.owner.frames.clear()  # the last view of the segment dies: RELEASE
    await exchange(dialer, listener, lambda: pool.stats["segments_in_use"] == 0)
    assert pool.stats["segments_idle"] == 1


@shared_memory
async def test_a_release_leaves_ahead_of_a_message_still_waiting_for_its_copy(
    pool: HeldCopies,
) -> None:
    dialer, listener = await connected(segments=pool)
    await delivered_through_segment(listener, dialer, pool)
    dialer.send(2, b"", (large(2),))  # its copy is held: it waits
    dialer.owner.frames.clear()  # the view of the listener's segment dies: RELEASE
    await exchange(dialer, listener, lambda: pool.stats["segments_in_use"] == 1)
    assert listener.received() == []  # message 2 still waits for its copy
    pool.finish(1)
    await exchange(dialer, listener, lambda: listener.received() == [2])


@shared_memory
async def test_a_message_written_after_a_release_carries_it_first(pool: HeldCopies) -> None:
    """A caller that drops a result and calls again at once: the release is in the
    very write of the call, ahead of it, so the peer can reuse that segment for it."""
    dialer, listener = await connected(segments=pool)
    await delivered_through_segment(listener, dialer, pool)
    writes = len(dialer.transport.writes)
    dialer.owner.frames.clear()  # RELEASE, from the loop thread
    dialer.send(2)
    assert len(dialer.transport.writes) == writes + 1
    feed(listener, dialer.transport.writes[-1], chunk=len(dialer.transport.writes[-1]))
    assert listener.received() == [2]
    assert pool.stats["segments_in_use"] == 0  # handled before message 2


@shared_memory
async def test_a_release_that_comes_up_after_a_warm_copy_in_its_turn_leads_it(
    pool: HeldCopies,
) -> None:
    """A caller's previous result dies only when asyncio lets go of the step that sent
    the next call (the finished future it awaited holds the result until then): the
    call, copied on the loop, waits for the next turn, and that release goes first."""
    dialer, listener = await connected(segments=pool)
    await delivered_through_segment(listener, dialer, pool)  # the dialer maps it
    await warm_segment(dialer, listener, pool, SHM_THRESHOLD)
    writes = len(dialer.transport.writes)
    dialer.send(2, b"", (large(2),))  # into the warm segment, here: no copier
    assert pool.held and len(pool.held) == 2 and pool.stats["segments_in_use"] == 2
    dialer.owner.frames.clear()  # then the view of the listener's segment dies
    assert len(dialer.transport.writes) == writes
    await asyncio.sleep(0)
    sent = b"".join(dialer.transport.writes[writes:])
    feed(listener, sent, chunk=len(sent))
    assert listener.received() == [2]
    assert pool.stats["segments_in_use"] == 1  # the release was handled before message 2


# -- encoding off the loop (what a pool thread does for a reply) -----------------------


@shared_memory
async def test_encode_puts_large_buffers_in_segments_for_a_same_host_peer(
    pool: HeldCopies,
) -> None:
    dialer, listener = await connected(segments=pool)
    writes = len(dialer.transport.writes)
    parts = dialer.link.encode(Kind.NOTICE, {"i": 1}, b"pay", [large(7), memoryview(b"small")])
    assert pool.held == [] and pool.stats["segments_in_use"] == 1  # copied right there
    assert len(dialer.transport.writes) == writes  # encoding writes nothing
    dialer.link.write(parts)
    assert sum(len(p) for p in parts) < SHM_THRESHOLD  # the large buffer is not inline
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    frame = listener.owner.frames[0]
    assert (bytes(frame.payload), frame.meta["i"]) == (b"pay", 1)
    assert [bytes(b) for b in frame.buffers] == [bytes(large(7)), b"small"]


@shared_memory
async def test_encode_sends_large_buffers_inline_to_another_host(pool: HeldCopies) -> None:
    dialer, listener = await connected(segments=pool, hosts=(HOST_A, HOST_B))
    parts = dialer.link.encode(Kind.NOTICE, {"i": 1}, b"", [large(8)])
    assert pool.stats["segments_in_use"] == 0
    assert sum(len(p) for p in parts) > SHM_THRESHOLD
    dialer.link.write(parts)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(large(8))


@shared_memory
@pytest.mark.parametrize(
    ("theirs", "why"),
    [
        ("boot=a,net=2,pid=2,uid=0", "different PID namespace"),  # another pod of the node
        ("boot=a,net=1,pid=1,uid=7", "different user"),
        ("boot=a,net=1,uid=0", "PID namespace unknown"),  # not proven: not assumed
        ("host-a", "kernel unknown"),  # a form this version does not read
    ],
)
async def test_no_shared_memory_with_a_peer_of_this_kernel_that_cannot_map_it(
    pool: HeldCopies, theirs: str, why: str
) -> None:
    dialer, listener = await connected(segments=pool, hosts=(HOST_A, theirs))
    assert dialer.link.sharing == {"shared_memory": False, "shared_memory_why": why}
    dialer.send(1, b"", (large(1),))
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert not pool.held and pool.stats["segments_in_use"] == 0  # inline, by the socket
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(large(1))


@shared_memory
async def test_no_shared_memory_with_a_peer_that_could_not_map_our_probe(
    pool: HeldCopies,
) -> None:
    """The hosts say yes, but the peer cannot open our probe (here: it is closed), so
    it could not open our segments either: nothing is lent, nothing is lost."""
    assert pool._probe is not None
    pool._probe.close()
    dialer, listener = await connected(segments=pool)
    sharing = dialer.link.sharing
    assert sharing["shared_memory"] is False
    assert sharing["shared_memory_why"].startswith("probe segment not mapped: ")
    dialer.send(1, b"", (large(1),))
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert not pool.held and pool.stats["segments_in_use"] == 0  # inline, by the socket
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(large(1))


@shared_memory
async def test_shared_memory_with_a_peer_of_another_network_namespace(pool: HeldCopies) -> None:
    """Memory needs the kernel, the PID namespace and the user, not the network."""
    dialer, listener = await connected(segments=pool, hosts=(HOST_A, "boot=a,net=9,pid=1,uid=0"))
    why = "same kernel, PID namespace and user"
    assert dialer.link.sharing == {"shared_memory": True, "shared_memory_why": why}
    dialer.send(1, b"", (large(1),))
    pool.finish(0)
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 1)
    assert pool.stats["segments_in_use"] == 1
    assert bytes(listener.owner.frames[0].buffers[0]) == bytes(large(1))


@shared_memory
async def test_encode_without_a_payload_sends_an_empty_one(pool: HeldCopies) -> None:
    dialer, listener = await connected(segments=pool)
    dialer.link.write(dialer.link.encode(Kind.NOTICE, {"i": 1}))
    dialer.link.write(dialer.link.encode(Kind.NOTICE, {"i": 2}, buffers=[large(2)]))
    await exchange(dialer, listener, lambda: len(listener.owner.frames) == 2)
    assert [bytes(f.payload) for f in listener.owner.frames] == [b"", b""]


@shared_memory
async def test_encode_refuses_too_large_a_message_before_lending_a_segment(
    pool: HeldCopies,
) -> None:
    dialer = end(Role.DIALER, "dialer", segments=pool)
    listener = end(Role.LISTENER, "listener", segments=pool, max_frame_size=SHM_THRESHOLD)
    await exchange(
        dialer, listener, lambda: dialer.link.ready.done() and listener.link.ready.done()
    )
    with pytest.raises(LocalProtocolError, match=r"reply of g from worker 'dialer'"):
        dialer.link.encode(Kind.RESPONSE, {"i": 1}, b"x", [large(9)], function="g")
    assert pool.stats["segments_in_use"] == 0


@shared_memory
async def test_encode_for_a_link_lost_meanwhile_gives_its_segments_back(
    pool: HeldCopies,
) -> None:
    dialer, _ = await connected(segments=pool)
    dialer.link.abort(RemoteProtocolError("gone"))
    dialer.link.encode(Kind.NOTICE, {"i": 1}, b"", [large(10)])
    assert pool.stats["segments_in_use"] == 0  # nobody will ever release them
