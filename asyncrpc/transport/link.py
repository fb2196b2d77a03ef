"""A Link: one authenticated, framed, flow-controlled connection to one peer.

Theory of operation
-------------------
A Link is an ``asyncio.BufferedProtocol``: the event loop asks it for memory
(``get_buffer``) and the decoder answers with staging space or with the very
storage a large tensor will live in, so received bytes are copied once, by the
kernel.  Complete frames first drive the handshake; only once it is
established do frames reach the :class:`LinkHandler` (the agent).

Limits before trust: until the handshake is established the decoder holds
``HANDSHAKE_LIMITS`` (handshake kinds only, a few KB per frame, a 4 KiB
staging area), so an unauthenticated peer can neither make us allocate a
large body nor send a call: either drops the connection as soon as the frame's
header is parsed.  Established, the decoder takes this worker's
``max_frame_size`` and grows its staging area.  Both ends announced their
``max_frame_size`` in the handshake: ``max_send_size`` is the smaller one, and
a message above it fails, before anything is written, with
``LocalProtocolError`` naming the peer, the function and both limits, so only
that message fails and the link stays up.

Sending: ``encode`` turns a message into byte parts (any thread may call it;
large buffers to a same-host peer are copied into shared-memory segments right
there), and ``write`` queues parts on the loop.  Same-host here is proven, not
assumed: in the handshake each end judges the other's probe segment (their hosts
must share a kernel, a PID namespace and a user, ``locality.MEMORY``, and the probe
must open and map), and segments are lent only to a peer that could map ours, and
taken only from one whose probe we mapped; ``sharing`` says whether, and why (a link
between two pods of one node shares none).  ``send`` does both on the
loop, but copies little there: a message with a buffer of ``SHM_THRESHOLD`` or
more for a same-host peer is encoded at once (its segments lent, so their keys
are known, and any encoding error raised to the caller), and its segments are
filled by the segment pool's copier threads, unless the copy is small
(``INLINE_COPY_MAX``) and its segments warm (then it is copied at once, and
leaves in the next loop turn).  Until they are filled, that
message and every later one on this link wait in ``_queue``, and leave in
order: a link is FIFO whatever its messages carry (``close`` waits for the
queue too; a copy always finishes).  A message without such buffers, on a link
with nothing queued, goes on to be written at once, with no thread hop.  A buffer the
pool's budget has no room for goes through the socket, inline, as a buffer
under the threshold would.

When a message leaves is the :class:`~asyncrpc.transport.flow.WriteCoalescer`'s
call: at once, unless it follows another within ``COALESCE_WITHIN`` in the same
loop turn; then it leaves with its burst, in one ``writelines``, at the turn's
end.  When the transport's buffer passes its high-water mark (``pause_writing``),
parts wait in the coalescer's outbox until ``resume_writing``; ``close`` writes
them anyway (the transport buffers them and writes them before it closes).

Striping (tcp links whose ends share no memory; :mod:`.stripes`): both ends offer side
connections in the handshake, the dialer connects them, and a buffer of ``STRIPE_MIN``
or more crosses them on threads, while its message, with an ``ExternalRef`` in its
place, crosses the link.  A message that carries one waits in ``_queue`` while they are
being connected, and goes inline if they fail (the dialer tells the listener with
STRIPES); the receiver holds a message, and every later one, until its striped buffers
are in (``_held``).  A side connection lost once in use loses the link.

Receiving: complete frames are handed up at most ``FRAMES_PER_TURN`` per loop
turn, a BATCH frame's messages (a burst's small ones, :mod:`.flow`) one by one as
if each had come in a frame of its own (``_unbatched``); while frames wait for a
later turn (catching up), or while the owner has paused the link
(``pause_reading``), the transport reads no more
(:class:`~asyncrpc.transport.flow.ReadGate`).

Segment bookkeeping travels both ways: RELEASE tells the peer we no longer map
its segments (our tensors on them died), UNMAP tells it that we closed
segments it may still have mapped, so that its cache lets go of them.  Their keys
are batched per loop turn and jump the queue: they never wait behind a message
whose segments are still being filled, and the next message written carries any
that are pending ahead of itself (so a caller's next call follows the release of
the tensor it just dropped, and the peer can reuse that segment for its reply).  A
message copied into its segments on the loop leaves in the next loop turn, not at
once: a result dropped in the step that sends the next call dies when that step ends.

Any protocol violation or transport error closes the Link; ``link_lost`` is
then called exactly once, with the cause, so the owner can fail every call
that was waiting on this peer.  A tcp link also has the kernel drop it once the
peer stays silent for ``silence_timeout`` seconds (:mod:`.liveness`): a silent
peer is lost, not slow forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar, cast

from asyncrpc.errors import (
    HandshakeError,
    LocalProtocolError,
    PeerLostError,
    ProtocolError,
    RemoteProtocolError,
)
from asyncrpc.transport.flow import MAX_BATCH_BYTES, Parts, ReadGate, WriteCoalescer
from asyncrpc.transport.liveness import DEFAULT_SILENT_PEER_TIMEOUT, detect_silence
from asyncrpc.transport.locality import MEMORY, Host
from asyncrpc.transport.shm import (
    DEFAULT_BUDGET,
    SHM_THRESHOLD,
    Segment,
    SegmentMapper,
    SegmentPool,
    fill_all,
    open_probe,
)
from asyncrpc.transport.stripes import (
    STRIPE_MIN,
    STRIPES_SETUP_TIMEOUT,
    StripedParts,
    StripeListener,
    Stripes,
    is_striped,
)
from asyncrpc.wire import (
    BATCHED_PAYLOAD_MAX,
    HANDSHAKE_LIMITS,
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
    encode_entry,
    encode_frame,
    split_batch,
)

log = logging.getLogger("asyncrpc.transport")
FRAMES_PER_TURN = 32
"""Frames handed up per loop turn before the loop gets to run other work."""
_RELEASE: Final = int(Kind.RELEASE)  # (the kinds a link handles itself, as ints: every
_UNMAP: Final = int(Kind.UNMAP)  # frame is compared with them)
_STRIPES: Final = int(Kind.STRIPES)
_BATCH: Final = int(Kind.BATCH)
_T = TypeVar("_T")
INLINE_COPY_MAX = 4 << 20
"""Bytes.  A copy this small into a warm segment (pages faulted in by an earlier copy)
runs on the loop: it costs other work no more than a trip to a copier thread and back
would cost this message (docs/architecture.md, "Copies off the loop")."""
Fills = list[tuple[Segment, memoryview]]
_SILENT = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH)
"""How the kernel reports a tcp connection it dropped for silence (``.liveness``): timed
out, with the last ICMP or neighbour error if there was one (the peer's own errors,
such as a reset, arrive at once and say something else)."""


@dataclass(slots=True)
class _Queued:
    """A message waiting for its turn: ``ready`` once its segments are filled."""

    parts: Parts
    ready: bool


def too_large(
    what: str, nbytes: int, limits: Mapping[str, int], **details: Any
) -> LocalProtocolError:
    """The error for a message above some worker's ``max_frame_size`` (``limits``: by
    worker name, the receiver first)."""
    accepts = ", ".join(f"worker {name!r} accepts {limit}" for name, limit in limits.items())
    return LocalProtocolError(
        f"{what} carries {nbytes} bytes, more than max_frame_size allows ({accepts} bytes)",
        nbytes=nbytes,
        **details,
    )


class LinkHandler(Protocol):
    """What a Link reports to its owner."""

    def link_established(self, link: Link) -> None: ...
    def frame_received(self, link: Link, frame: Frame) -> None: ...
    def frames_sent(self, link: Link) -> None: ...
    def link_lost(self, link: Link, exc: BaseException) -> None: ...


class Link(asyncio.BufferedProtocol):
    """One connection; see the module docstring."""

    def __init__(
        self,
        handler: LinkHandler,
        handshake: Handshake,
        *,
        allocate: Allocator,
        segments: SegmentPool | None = None,
        max_mapped_bytes: int = DEFAULT_BUDGET,
        handshake_timeout: float = 10.0,
        silence_timeout: float = DEFAULT_SILENT_PEER_TIMEOUT,
        stripes: StripeListener | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.handler = handler
        self.handshake = handshake
        self._up = False  # the handshake is established (read on every frame)
        self.max_frame_size = handshake.max_frame_size  # the largest body we accept
        self.max_send_size = self.max_frame_size  # and the peer's, once it is known
        self.ready: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        self.closed = False  # lost: ``link_lost`` was called
        self.closing = False  # lost, or ``close()`` was called
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._decoder = FrameDecoder(HANDSHAKE_LIMITS, allocate=allocate)
        self._unbatched: deque[Frame] = deque()  # a BATCH frame's messages not handed up yet
        self._allocate = allocate
        self._stripe_listener = stripes
        self._stripes: Stripes | None = None  # side connections, once both ends offered them
        self.stripes_why = "handshake not done"
        self._held: deque[tuple[Frame, set[int]]] = deque()  # behind a striped buffer
        self._segments = segments
        self._lends = False  # the peer proved it maps our segments, and we have a pool
        self._takes = False  # we mapped the peer's probe: its segment references are good
        handshake.offer_memory(None if segments is None else segments.probe_key, self._judge)
        self._max_mapped_bytes = max_mapped_bytes
        self._mapper = SegmentMapper(0)  # the peer's pid is known after the handshake
        self._transport: asyncio.Transport | None = None
        self._queue: deque[_Queued] = deque()  # behind a message whose segments are filling
        self._close_when_sent = False
        self._writes = WriteCoalescer(clock, paused=True)  # until connection_made
        self._reads = ReadGate()
        self._segment_keys: dict[Kind, list[int]] = {}  # RELEASE and UNMAP, batched
        self._handshake_timeout = handshake_timeout
        self._stripes_timer: asyncio.TimerHandle | None = None  # bounds their setting up
        self._handshake_timer = self._loop.call_later(handshake_timeout, self._handshake_expired)
        self.silence_timeout = silence_timeout  # tcp only; 0: the kernel's defaults
        self.transport_kind = "?"  # "unix" or "tcp" once connected
        self.bytes_sent = 0  # through the socket, frames and inline buffers
        self.bytes_received = 0
        self.shared_bytes_received = 0  # buffers read from the peer's segments (what we
        # lent, the pool counts: segments are filled on other threads too)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the peer's segments this link keeps mapped for reuse."""
        return self._mapper.cached_bytes

    @property
    def sharing(self) -> dict[str, Any]:
        """Whether the large buffers we send travel through shared memory, and why."""
        if self._lends:
            why = f"same {MEMORY.name}"
        elif not self.handshake.established:
            why = "handshake not done"
        elif self._segments is None:
            why = "shared_memory=False here"
        else:
            why = self.handshake.peer_maps or "?"
        return {"shared_memory": self._lends, "shared_memory_why": why}

    @property
    def peer(self) -> Identity:
        assert self.handshake.peer is not None, "peer is known once the handshake is done"
        return self.handshake.peer

    @property
    def max_frame_sizes(self) -> dict[str, int]:
        """``max_frame_size`` by worker name: the peer's (once known), then ours."""
        peer, theirs = self.handshake.peer, self.handshake.peer_max_frame_size
        ours = {self.handshake.local.name: self.max_frame_size}
        return ours if peer is None or theirs is None else {peer.name: theirs, **ours}

    def __repr__(self) -> str:
        peer = self.handshake.peer.name if self.handshake.peer else "?"
        return f"<Link {self.handshake.role.name.lower()} peer={peer}>"

    # -- asyncio callbacks ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        transport = self._transport
        transport.set_write_buffer_limits(high=4 << 20)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            detect_silence(sock, self.silence_timeout)
        if sock is not None:
            self.transport_kind = "unix" if sock.family == socket.AF_UNIX else "tcp"
        if self.transport_kind == "tcp" and self._stripe_listener is not None:
            listener = self._stripe_listener
            self.handshake.offer_stripes(listener.port, listener.count)
        self._write_parts(self._writes.resume())
        for kind, meta in self.handshake.start():
            self.send(kind, meta)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self._decoder.buffer_updated(nbytes)
        self._process_frames()

    def _process_frames(self) -> None:
        """Hand complete frames up, a few per loop turn, unless reading is paused.

        Handing up at most FRAMES_PER_TURN frames, then letting the loop run (tasks,
        flushes of replies) before coming back, overlaps our work with the peer's:
        a burst of requests is answered in slices instead of all at the end.
        """
        try:
            for _ in range(FRAMES_PER_TURN):
                if self.closed or self._reads.paused:
                    return
                if self._unbatched:
                    frame: Frame | object = self._unbatched.popleft()
                else:
                    frame = self._decoder.next_event()
                if frame is NEED_DATA:
                    self._update_reading(self._reads.catch_up())
                    return
                assert isinstance(frame, Frame)
                self._dispatch(frame)
        except (ProtocolError, HandshakeError) as exc:
            self.abort(exc)
            return
        except Exception as exc:  # a bug of ours: say so, then fail this link's calls
            log.exception("internal error handling a frame on %r; dropping the link", self)
            self.abort(exc)
            return
        self._update_reading(self._reads.fall_behind())
        self._loop.call_soon(self._process_frames)

    def _update_reading(self, changed: bool) -> None:
        """Tell the transport whether to read, if the read gate ``changed``."""
        if changed and self._transport is not None and not self.closed:
            if self._reads.reading:
                self._transport.resume_reading()
            else:
                self._transport.pause_reading()

    def eof_received(self) -> bool:
        self.abort(self._lost_error("closed the connection"))
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if isinstance(exc, OSError) and exc.errno in _SILENT and self.silence_timeout > 0:
            what = (
                f"silent for {self.silence_timeout:g}s (silent_peer_timeout): no answer to "
                f"our bytes or keepalive probes ({exc.strerror}); a network partition, or "
                "its host is down"
            )
        else:
            what = f"connection lost ({exc or 'closed'})"
        error = self._lost_error(what)
        error.__cause__ = exc
        self._finish(error)

    def pause_writing(self) -> None:
        self._writes.pause()

    def resume_writing(self) -> None:
        self._write_parts(self._writes.resume())

    # -- sending -------------------------------------------------------------------

    def encode(
        self,
        kind: int,
        meta: dict[str, Any],
        payload: bytes | memoryview = b"",
        buffers: Sequence[memoryview] = (),
        *,
        function: str = "?",
    ) -> Parts:
        """Byte parts for one message, large buffers copied into segments here; safe
        to call from any thread.  A message above ``max_send_size`` raises
        ``LocalProtocolError`` (naming ``function``, the call it belongs to) before
        anything is written or shared."""
        return self._checked(self._encode, kind, meta, payload, buffers, function=function)

    def _encode(
        self,
        kind: int,
        meta: dict[str, Any],
        payload: bytes | memoryview,
        buffers: Sequence[memoryview],
    ) -> Parts:
        pool = self._segments if self._lends_segments() else None
        if pool is None or not _has_large(buffers):
            return self._encode_through_socket(kind, meta, payload, buffers)
        refs = [self._put(pool, b) for b in buffers]
        if self.closed:  # lost meanwhile (on the loop): what we were lent is nobody's
            pool.forget(self)
        try:
            return encode_frame(kind, meta, payload, refs, max_frame_size=self.max_send_size)
        except BaseException:
            pool.release([r.key for r in refs if isinstance(r, ExternalRef)], self)
            raise

    def _encode_through_socket(
        self,
        kind: int,
        meta: dict[str, Any],
        payload: bytes | memoryview,
        buffers: Sequence[memoryview],
    ) -> Parts:
        """Parts for a message whose buffers do not go through shared memory: buffers of
        ``STRIPE_MIN`` or more cross the side connections, if they are up or being
        connected (``StripedParts``), the rest the link's stream."""
        stripes = self._stripes
        if stripes is None or stripes.closed or not _has(buffers, STRIPE_MIN):
            return encode_frame(kind, meta, payload, buffers, max_frame_size=self.max_send_size)
        refs: list[memoryview | ExternalRef] = []
        striped: list[tuple[int, memoryview]] = []
        for buffer in buffers:
            if buffer.nbytes < STRIPE_MIN:
                refs.append(buffer)
                continue
            key = stripes.next_key()
            refs.append(ExternalRef(key, buffer.nbytes))
            striped.append((key, buffer))
        parts = encode_frame(kind, meta, payload, refs, max_frame_size=self.max_send_size)
        inline = functools.partial(
            encode_frame, kind, meta, payload, buffers, max_frame_size=self.max_send_size
        )
        return StripedParts(parts, striped, inline)

    def _put(self, pool: SegmentPool, buffer: memoryview) -> memoryview | ExternalRef:
        """A segment's reference for a large buffer, if the budget has room; else itself."""
        ref = pool.put(buffer, self) if buffer.nbytes >= SHM_THRESHOLD else None
        return buffer if ref is None else ref

    def send(
        self,
        kind: int,
        meta: dict[str, Any],
        payload: bytes | memoryview = b"",
        buffers: Sequence[memoryview] = (),
        *,
        function: str = "?",
    ) -> None:
        """Encode and queue one message (loop thread only); large same-host buffers are
        copied by the segment pool's threads (here if small and warm), and the message,
        with every later one, waits for them.  Too large a message raises, as ``encode``."""
        self._checked(self._send, kind, meta, payload, buffers, function=function)

    def _checked(
        self,
        act: Callable[[int, dict[str, Any], bytes | memoryview, Sequence[memoryview]], _T],
        kind: int,
        meta: dict[str, Any],
        payload: bytes | memoryview,
        buffers: Sequence[memoryview],
        *,
        function: str,
    ) -> _T:
        """``act(kind, meta, payload, buffers)`` for a message within ``max_send_size``
        (else ``LocalProtocolError``); an encoder's error about it names it."""
        self._check_size(kind, payload, buffers, function)
        try:
            return act(kind, meta, payload, buffers)
        except LocalProtocolError as exc:
            raise self._named(exc, kind, function) from None

    def _send(
        self,
        kind: int,
        meta: dict[str, Any],
        payload: bytes | memoryview,
        buffers: Sequence[memoryview],
    ) -> None:
        if buffers and self._lends_segments() and _has_large(buffers) and not self.closed:
            self._send_through_segments(kind, meta, payload, buffers)
            return
        if not buffers and len(payload) <= BATCHED_PAYLOAD_MAX and self._joins_burst():
            # An entry of its burst's BATCH frame, unless too large for one (a long meta,
            # a peer's small frames): then a frame of its own, as any other message.
            entry = encode_entry(kind, meta, payload)
            if self._writes.fits_batch(entry):
                first_in_turn = not self._writes.in_turn
                self._after_write(first_in_turn, self._writes.send_entry(entry))
                return
        self.write(self._encode_through_socket(kind, meta, payload, buffers))

    def _joins_burst(self) -> bool:
        """Whether a small message sent now waits with a burst in the coalescer, and may
        travel as an entry of its BATCH frame: nothing queued for segments before it,
        no segment keys to lead it (``_write_now`` puts those first), not closed."""
        return (
            self._up
            and not self._queue
            and not self._segment_keys
            and not self.closed
            and self._writes.holds_next()
        )

    def _lends_segments(self) -> bool:
        """Large buffers go through segments: the peer proved it maps ours, and this
        worker has a segment pool (``shared_memory=False`` has none; it still maps the
        segments of a peer that lends them)."""
        return self._lends

    def _check_size(
        self, kind: int, payload: bytes | memoryview, buffers: Sequence[memoryview], function: str
    ) -> None:
        size = len(payload) + sum(b.nbytes for b in buffers)
        if size > self.max_send_size:
            raise self._too_large(kind, size, function)

    def _too_large(self, kind: int, nbytes: int, function: str) -> LocalProtocolError:
        what, peer = self._describe(kind, function), self._peer_name()
        return too_large(what, nbytes, self.max_frame_sizes, worker=peer, function=function)

    def _named(self, exc: LocalProtocolError, kind: int, function: str) -> LocalProtocolError:
        """``exc`` from the frame encoder, saying which message it was about, if it does
        not say so already (a header too long: too many buffers, or too long a meta)."""
        header = exc.details.get("header_bytes")
        if header is None:
            return exc
        peer = self._peer_name()
        return LocalProtocolError(
            f"{self._describe(kind, function)} cannot be sent: {exc}; send its tensors "
            f"in several messages, or fewer larger ones",
            header_bytes=header,
            worker=peer,
            function=function,
        )

    def _describe(self, kind: int, function: str) -> str:
        peer = self._peer_name()
        if kind == Kind.REQUEST:
            return f"call to {function} on worker {peer!r}"
        if kind in (Kind.RESPONSE, Kind.ERROR):
            local = self.handshake.local.name
            return f"reply of {function} from worker {local!r} to worker {peer!r}"
        return f"{Kind(kind).name} message to worker {peer!r}"

    def _peer_name(self) -> str:
        return self.handshake.peer.name if self.handshake.peer else "?"

    def _send_through_segments(
        self,
        kind: int,
        meta: dict[str, Any],
        payload: bytes | memoryview,
        buffers: Sequence[memoryview],
    ) -> None:
        pool = self._segments
        assert pool is not None
        refs, fills = self._lend(pool, buffers)
        try:
            parts = encode_frame(kind, meta, payload, refs, max_frame_size=self.max_send_size)
        except BaseException:
            pool.release([segment.key for segment, _ in fills], self)
            raise
        retry = functools.partial(encode_frame, kind, meta, payload, buffers)
        if not fills:  # over budget: the buffers go inline, through the socket
            self.write(parts)
        elif _cheap_to_copy(fills):
            self._write_next_turn(self._fill_here(fills, parts, retry))
        else:
            self._fill_in_copier(pool, fills, parts, retry)

    def _fill_here(self, fills: Fills, parts: Parts, retry: functools.partial[Parts]) -> Parts:
        """Copy on the loop (a warm copy of at most INLINE_COPY_MAX bytes)."""
        try:
            fill_all(fills)
        except Exception as exc:
            return self._copy_failed(fills, retry, exc)
        return parts

    def _write_next_turn(self, parts: Parts) -> None:
        """Queue a message whose segments are filled to leave in the next loop turn.  A
        caller that dropped its previous result in the step that sends this call still
        holds it until that step ends (asyncio's callback keeps the future that carried
        it), so only then is the result's segment released; waiting a turn lets that
        RELEASE lead the call, and the peer reuse the segment for its reply instead of
        faulting in a new one (second 4 MB echo of a fresh pair: ~4.5 -> ~1.1 ms here)."""
        queued = _Queued(parts, ready=False)
        self._queue.append(queued)
        self._loop.call_soon(self._now_ready, queued)

    def _now_ready(self, queued: _Queued) -> None:
        queued.ready = True
        self._write_ready()

    def _fill_in_copier(
        self, pool: SegmentPool, fills: Fills, parts: Parts, retry: functools.partial[Parts]
    ) -> None:
        """Have a copier thread fill the segments; the message waits in ``_queue``."""
        try:
            job = asyncio.wrap_future(pool.fill_later(fills), loop=self._loop)
        except BaseException:  # the pool is closed
            pool.discard([segment for segment, _ in fills])
            raise
        queued = _Queued(parts, ready=False)
        self._queue.append(queued)
        job.add_done_callback(functools.partial(self._filled, queued, fills, retry))

    def _lend(
        self, pool: SegmentPool, buffers: Sequence[memoryview]
    ) -> tuple[list[memoryview | ExternalRef], Fills]:
        """A segment for each large buffer the budget has room for (not filled yet)."""
        refs: list[memoryview | ExternalRef] = []
        fills: Fills = []
        for buffer in buffers:
            segment = pool.lend(buffer.nbytes, self) if buffer.nbytes >= SHM_THRESHOLD else None
            if segment is None:
                refs.append(buffer)
            else:
                refs.append(segment.ref(buffer.nbytes))
                fills.append((segment, buffer))
        return refs, fills

    def _filled(
        self,
        queued: _Queued,
        fills: Fills,
        retry: functools.partial[Parts],
        job: asyncio.Future[None],
    ) -> None:
        """A queued message's segments are filled: write what is ready, in order."""
        if self.closed:
            return  # its segments were closed with the link
        error = job.exception() if not job.cancelled() else asyncio.CancelledError()
        if error is not None:
            queued.parts = self._copy_failed(fills, retry, error)
        self._now_ready(queued)

    def _write_ready(self) -> None:
        """Write the queued messages that are ready, in order, up to the first that is not."""
        while self._queue and self._queue[0].ready:
            self._write_now(self._queue.popleft().parts)
        if self._close_when_sent and not self._queue:
            self.close()

    def _copy_failed(
        self, fills: Fills, retry: functools.partial[Parts], error: BaseException
    ) -> Parts:
        """A bug, but the bytes can still go through the socket: the message, all inline."""
        log.warning("%r: copy into shared memory failed (%r); using the socket", self, error)
        if self._segments is not None:
            self._segments.discard([segment for segment, _ in fills], fallback=True)
        return retry(max_frame_size=self.max_send_size)

    def write(self, parts: Parts) -> None:
        """Send encoded parts, after any message still waiting for its segments; the
        striped buffers of ``StripedParts`` leave on the side connections now (or, while
        those are being connected, the message waits in ``_queue`` until they are up, or
        failed and it goes inline)."""
        if isinstance(parts, StripedParts) and not self.closed:
            stripes = self._stripes
            if stripes is None or stripes.closed:
                parts = parts.inline()
            elif not stripes.ready:
                self._queue.append(_Queued(parts, ready=False))
                return
            else:
                stripes.send(parts.stripes)
        if self._queue and not self.closed:
            self._queue.append(_Queued(parts, ready=True))
        else:
            self._write_now(parts)

    def _write_now(self, parts: Parts) -> None:
        """Hand a message to the coalescer (see ``WriteCoalescer``): it leaves now or
        with its burst at the end of this loop turn, after any segment keys queued
        meanwhile (``_send_keys``)."""
        if self.closed:
            return
        if self._segment_keys:
            parts = [*self._encode_keys(), *parts]
            if not parts:
                return
        first_in_turn = not self._writes.in_turn
        self._after_write(first_in_turn, self._writes.send(parts))

    def _after_write(self, first_in_turn: bool, parts: Parts) -> None:
        """Write what the coalescer let go for the message it was just handed; the turn's
        end is due if that was the turn's first message."""
        self._write_parts(parts)
        # What is left runs while the message travels.
        if first_in_turn:
            self._loop.call_soon(self._end_turn)
        self.handler.frames_sent(self)

    def _end_turn(self) -> None:
        self._write_parts(self._writes.end_turn())

    def _write_parts(self, parts: Parts) -> None:
        if parts and not self.closed:
            assert self._transport is not None, "writes wait until connection_made"
            self._transport.writelines(parts)
            for part in parts:
                self.bytes_sent += len(part)

    def segment_released(self, key: int) -> None:
        """A mapping of the peer's segment died (any thread): tell the peer, batched."""
        self._tell_peer(Kind.RELEASE, [key])

    def segments_closed(self, keys: list[int]) -> None:
        """Our pool closed segments lent on this link (any thread): the peer may unmap them."""
        self._tell_peer(Kind.UNMAP, keys)

    def _tell_peer(self, kind: Kind, keys: list[int]) -> None:
        """Queue keys for the peer.  On the loop thread they join the batch at once, so
        that a message written next in this turn (a user's next call, right after it
        dropped the tensor on a segment) carries them ahead of itself."""
        if self.closed:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            if threading.get_ident() == self._loop_thread:
                self._queue_keys(kind, keys)
            else:
                self._loop.call_soon_threadsafe(self._queue_keys, kind, keys)

    def _queue_keys(self, kind: Kind, keys: list[int]) -> None:
        if not self._segment_keys:
            self._loop.call_soon(self._send_keys)
        self._segment_keys.setdefault(kind, []).extend(keys)

    def _send_keys(self) -> None:
        """Queued RELEASE and UNMAP keys leave now, ahead of messages still waiting for
        their segments (neither refers to a segment such a message uses), so that the
        peer can reuse a released segment for the message that crosses them."""
        if self._segment_keys:
            self._write_now([])

    def _encode_keys(self) -> Parts:
        batches, self._segment_keys = self._segment_keys, {}
        if not self.handshake.established:
            return []
        return [
            part
            for kind, keys in batches.items()
            for part in encode_frame(kind, {"k": keys}, max_frame_size=self.max_send_size)
        ]

    # -- flow control for readers --------------------------------------------------

    def pause_reading(self) -> None:
        """Stop handing frames up (already-received ones wait) and stop reading the socket."""
        self._update_reading(self._reads.pause())

    def resume_reading(self) -> None:
        """Hand up the frames that waited (from the next loop turn on), then read again."""
        self._update_reading(self._reads.resume())
        self._deliver_held()
        self._loop.call_soon(self._process_frames)

    # -- receiving -----------------------------------------------------------------

    def _dispatch(self, frame: Frame) -> None:
        kind = frame.kind
        if not self._up:  # the decoder lets through nothing else until then
            self._on_handshake_frame(frame)
        elif kind == _RELEASE:
            if self._segments is not None:
                self._segments.release(_keys(frame), self)
        elif kind == _UNMAP:
            self._mapper.forget(_keys(frame))
        elif kind == _STRIPES:
            self._on_stripes_decided(frame.meta)
        elif kind == _BATCH:  # a burst's small messages: handed up next, one frame each
            self._unbatched.extend(split_batch(frame.payload, self._decoder.limits.kinds))
        else:
            waits = self._resolve_external(frame) if frame.buffers else None
            if waits or self._held:
                self._held.append((frame, set() if waits is None else waits))
            else:
                self.handler.frame_received(self, frame)

    def _on_handshake_frame(self, frame: Frame) -> None:
        outgoing = self.handshake.receive(frame.kind, frame.meta)
        if self.handshake.established:
            self._start_stripes()  # before WELCOME leaves: side connections may follow it
        for kind, meta in outgoing:
            self.send(kind, meta)
        if self.handshake.established:
            self._established()

    def _established(self) -> None:
        """The peer is authenticated: raise the limits, then tell the owner."""
        self._up = True
        self._handshake_timer.cancel()
        theirs = self.handshake.peer_max_frame_size
        assert theirs is not None, "announced in the handshake"
        self.max_send_size = min(self.max_frame_size, theirs)
        self._writes.max_batch_bytes = min(MAX_BATCH_BYTES, self.max_send_size)
        self._decoder.limits = Limits.established(self.max_frame_size)
        self._share_memory_if_proven()
        self._mapper = SegmentMapper(self.peer.pid, self._max_mapped_bytes)
        self.handler.link_established(self)
        if not self.ready.done():
            self.ready.set_result(self)

    def _share_memory_if_proven(self) -> None:
        """Lend segments if the peer could map our probe; take its if we mapped its."""
        self._lends = self.handshake.peer_maps is None and self._segments is not None
        self._takes = self.handshake.maps_peer is None

    # -- side connections (transport.stripes) --------------------------------------

    @property
    def striping(self) -> dict[str, Any]:
        """How many side connections carry our large buffers, and why (not)."""
        stripes = self._stripes
        count = stripes.count if stripes is not None and stripes.ready else 0
        return {"stripes": count, "stripes_why": self.stripes_why}

    @property
    def striped_bytes(self) -> tuple[int, int]:
        """Bytes sent and received on side connections."""
        stripes = self._stripes
        return (0, 0) if stripes is None else (stripes.bytes_sent, stripes.bytes_received)

    def _start_stripes(self) -> None:
        """Set up side connections if both ends offered them and share no memory (both
        ends judge that the same way): the dialer dials, the listener expects them."""
        listener, theirs = self._stripe_listener, self.handshake.peer_stripes
        if self.transport_kind != "tcp":
            self.stripes_why = "not a tcp link"
            return
        if listener is None or self.handshake.stripes is None:
            self.stripes_why = "tcp_stripes=0 here"
            return
        if theirs is None:
            self.stripes_why = "the peer offers none"
            return
        if self.handshake.peer_maps is None or self.handshake.maps_peer is None:
            self.stripes_why = "shared memory carries large buffers"
            return
        port, count = theirs
        stripes = self._stripes = Stripes(
            min(count, listener.count),
            self,
            self._loop.call_soon_threadsafe,
            prove=self.handshake.stripe_proof,
            allocate=self._allocate,
            max_bytes=self.max_frame_size,
            silence_timeout=self.silence_timeout,
            name=self.peer.name,
            confirmed=self.handshake.role is Role.DIALER,  # the dialer decides
        )
        self.stripes_why = "connecting"
        if self.handshake.role is Role.DIALER:
            bound = self._stripes_bound
            self._stripes_timer = self._loop.call_later(bound, self._stripes_expired)
            assert self._transport is not None
            host = self._transport.get_extra_info("peername")[0]
            stripes.dial(host, port, self.handshake.link_id, timeout=bound)
        else:  # bounded by the dialer's decision (or the link's loss)
            listener.expect(self.handshake.link_id, stripes)

    def stripes_ready(self) -> None:
        """Every side connection is up (and, for the listener, the dialer said so)."""
        self.stripes_why = "both ends offered them"
        if self.handshake.role is Role.DIALER:
            self.send(Kind.STRIPES, {"ok": True})  # ahead of any message that uses them
        self._settle_stripes()

    def stripe_arrived(self, key: int) -> None:
        """Every piece of striped buffer ``key`` is in: deliver what waited for it."""
        for _, waits in self._held:
            waits.discard(key)
        self._deliver_held()

    def stripes_sent(self) -> None:
        """Every piece handed to the side connections has left."""
        if self._close_when_sent and not self._queue:
            self.close()

    def _on_stripes_decided(self, meta: dict[str, Any]) -> None:
        """The dialer's word on the side connections (the listener's end)."""
        if self.handshake.role is not Role.LISTENER:
            raise RemoteProtocolError("STRIPES from the listener of a link")
        if meta.get("ok") is True:
            if self._stripes is not None:
                self._stripes.confirm()
        else:
            self._unstriped(f"the peer could not connect them ({meta.get('why')})")

    def stripes_failed(self, exc: BaseException) -> None:
        """Before they were up, side connections failing leave the link unstriped (and
        the dialer tells the listener); once in use, the link is lost."""
        if self._stripes is None:
            return  # given up already
        if not self._stripes.ready:
            why = f"side connections failed: {exc}"
            if self.handshake.role is Role.DIALER and not self.closing:
                self.send(Kind.STRIPES, {"why": why})  # the listener expects them no more
            self._unstriped(why)
            return
        error = self._lost_error(f"side connection lost ({exc})")
        error.__cause__ = exc
        self.abort(error)

    def _stripes_expired(self) -> None:
        """The side connections are not up in time: none will be."""
        if self._stripes is not None and not self._stripes.ready:
            self.stripes_failed(TimeoutError(f"not up within {self._stripes_bound:g}s"))

    @property
    def _stripes_bound(self) -> float:
        """Seconds the side connections may take to be up (messages with large buffers
        wait for them meanwhile)."""
        return min(self._handshake_timeout, STRIPES_SETUP_TIMEOUT)

    def _unstriped(self, why: str) -> None:
        """Side connections that are not up yet never will be: this link carries all,
        queued messages included."""
        if self._stripes is None or self._stripes.ready:
            return
        self.stripes_why = why
        self._drop_stripes()
        self._stripes = None
        self._settle_stripes()

    def _settle_stripes(self) -> None:
        """The side connections are up, or failed: messages that waited for them leave."""
        if self._stripes_timer is not None:
            self._stripes_timer.cancel()
        stripes = self._stripes
        for queued in self._queue:
            parts = queued.parts
            if not queued.ready and isinstance(parts, StripedParts):
                if stripes is not None and stripes.ready:
                    stripes.send(parts.stripes)
                else:
                    queued.parts = parts.inline()
                queued.ready = True
        self._write_ready()

    def _drop_stripes(self) -> None:
        """Close the side connections (their byte counts stay)."""
        if self._stripes is not None:
            self._stripes.close()
            if self._stripe_listener is not None:
                self._stripe_listener.forget(self.handshake.link_id)

    def _deliver_held(self) -> None:
        """Hand up, in order, the held messages whose striped buffers are all in."""
        while self._held and not self._held[0][1] and not self._reads.paused and not self.closed:
            self.handler.frame_received(self, self._held.popleft()[0])

    def _judge(self, peer: Identity, probe: int | None) -> str | None:
        """Whether we can map the (authenticated) peer's segments: None if our hosts share
        what it takes (``MEMORY``) and its probe opens and maps; else why not."""
        ours, theirs = Host.parse(self.handshake.local.host), Host.parse(peer.host)
        refusal = ours.refusal(theirs, MEMORY)
        if refusal is not None:
            return refusal
        return "the peer lends no shared memory" if probe is None else open_probe(peer.pid, probe)

    def _resolve_external(self, frame: Frame) -> set[int]:
        """Put each external buffer's storage in ``frame``; returns the keys of striped
        buffers still arriving."""
        waits: set[int] = set()
        for i, buf in enumerate(frame.buffers):
            if isinstance(buf, ExternalRef) and is_striped(buf.key):
                if self._stripes is None:
                    raise RemoteProtocolError("striped buffer on a link without side connections")
                frame.buffers[i], arrived = self._stripes.claim(buf.key, buf.nbytes)
                if not arrived:
                    waits.add(buf.key)
            elif isinstance(buf, ExternalRef):
                if not self._takes:
                    raise RemoteProtocolError(
                        f"shared-memory buffer from a peer that shares no memory with us "
                        f"({self.handshake.maps_peer})"
                    )
                frame.buffers[i] = view = self._mapper.view(buf, self.segment_released)
                self.shared_bytes_received += view.nbytes
        return waits

    # -- closing -------------------------------------------------------------------

    def close(self) -> None:
        """Close after queued bytes are written (messages waiting for their segments
        too: filling a segment always finishes)."""
        self.closing = True
        if self._queue or (self._stripes is not None and self._stripes.sending):
            self._close_when_sent = True
            return
        if self._transport is not None:
            self._write_parts(self._writes.drain())  # paused or not: the transport buffers
            self._transport.close()

    def abort(self, exc: BaseException) -> None:
        """Drop the connection now; ``link_lost`` reports ``exc``."""
        if self.closed:
            return
        if isinstance(exc, ProtocolError | HandshakeError):
            log.warning("dropping connection %r: %s", self, exc)
        self._finish(exc)
        if self._transport is not None:
            self._transport.abort()

    def _finish(self, exc: BaseException) -> None:
        if self.closed:
            return
        self.closed = self.closing = True
        self._handshake_timer.cancel()
        self._writes.drain()
        self._queue.clear()
        self._held.clear()
        if self._stripes_timer is not None:
            self._stripes_timer.cancel()
        self._drop_stripes()
        if self._segments is not None:
            self._segments.forget(self)
        self._mapper.clear()
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()  # retrieved: the dialer may have stopped waiting
        self.handler.link_lost(self, exc)

    def _handshake_expired(self) -> None:
        self.abort(HandshakeError(f"{self!r}: handshake not completed in time", timed_out=True))

    def _lost_error(self, what: str) -> PeerLostError:
        peer = self.handshake.peer
        if peer is None:  # not known yet (whoever dialed it names whom it dialed)
            return PeerLostError(f"before the handshake: {what}")
        return PeerLostError(f"worker {peer.name!r}: {what}", worker=peer.name)


def _cheap_to_copy(fills: Fills) -> bool:
    """At most INLINE_COPY_MAX bytes, into segments whose pages are faulted in already."""
    total = sum(len(data) for _, data in fills)
    return total <= INLINE_COPY_MAX and all(s.filled >= len(data) for s, data in fills)


def _has_large(buffers: Sequence[memoryview]) -> bool:
    return _has(buffers, SHM_THRESHOLD)


def _has(buffers: Sequence[memoryview], nbytes: int) -> bool:
    """Whether any buffer holds ``nbytes`` or more."""
    return any(b.nbytes >= nbytes for b in buffers)


def _keys(frame: Frame) -> list[int]:
    """The segment keys of a RELEASE or UNMAP frame."""
    keys = frame.meta.get("k", [])
    if not isinstance(keys, list) or not all(type(k) is int for k in keys):
        raise RemoteProtocolError(f"malformed segment keys in a message of kind {frame.kind}")
    return keys
