"""Striping: a large buffer on a tcp link crosses side connections, on threads.

Theory of operation
-------------------
One tcp stream is bounded by one thread's copy into and out of the kernel on each
side, and a Link is read on its event loop's thread.  A second stream brings a
second core's copy (``benchmarks/tcp_floor.py``: raw sockets move about twice as much
with two, on loopback and over veth; asyncrpc's large echoes gained 25-35 % over veth
and 8-19 % over loopback on 2 cores; docs/architecture.md, "TCP between hosts").  So a tcp
link whose two ends both offer it opens ``count`` *side connections*, and a buffer
of ``STRIPE_MIN`` bytes or more leaves through them instead of the link's stream.

Setting up.  In the link's handshake each end offers its :class:`StripeListener`'s
port and its count; once the link is established, the dialer connects ``min`` of
the two counts to the listener's port at the address it dialed, and proves on each
that it is the link's dialer: ``HELLO`` carries the link's id (the dialer's
handshake nonce) and an HMAC of the job's secret over both nonces, both names and the
side connection's index; the listener answers ``ACK`` with its own proof.  Nothing
unproven is read beyond those fixed-size messages, and each waits a bounded time.
The dialer alone decides whether they are up, and says so to the listener in a
STRIPES message on the link, which sends nothing on them before: side connections
that are not all up within ``STRIPES_SETUP_TIMEOUT`` (a firewall that lets only the
main port through) leave the link unstriped on both ends, its stream carrying
everything, as before, and its debug info saying why.  A message with a large buffer
sent meanwhile waits for the outcome.

Sending.  ``Link.encode`` gives a large buffer an ``ExternalRef`` whose key has
``STRIPE_KEY`` set, and returns :class:`StripedParts`; when they are written, the
buffer is handed to the side connections' sender threads in ``CHUNK`` pieces, dealt
round-robin, each behind a header (key, total, offset, length).  The link's stream
carries the message itself at once.  Pieces are sent from the caller's memory (the
send contract of the module ``serde`` holds: a buffer is not changed until its call
completes).  ``Link.close`` waits until every piece has left.

Receiving.  A reader thread per side connection reads each header, finds (or makes,
with the link's allocator) the buffer that key names, checks the piece is one of the
sender's layout (``piece_size``) and new, faults it in if fresh, and reads it straight
into place.  The message's frame, arriving on the link's
stream before or after its pieces, ``claim``\\s the same buffer; the Link holds that
message, and every message behind it, until the buffer is complete (``arrived``), so
the link stays FIFO.  Round-robin pieces fill a buffer from the front on every
connection at once, behind the storage pool's prefault thread.  (Each side connection
has a reader thread from the start, and a sender thread from the first send.)

Failure.  Any error on a side connection after it was set up (a reset, a silence
past ``silent_peer_timeout``, a malformed header) is the link's: the Link is
dropped with the cause, so every call waiting on it fails, as for a lost link.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.transport.liveness import detect_silence
from asyncrpc.transport.shm import fault_in
from asyncrpc.wire import Allocator

log = logging.getLogger("asyncrpc.transport")

STRIPE_KEY: Final = 1 << 63
"""Set in the key of an ``ExternalRef`` whose bytes cross side connections (a segment
key never has it: ``serial << 32 | fd``)."""
STRIPE_MIN: Final = 32 << 20
"""Bytes.  A smaller buffer stays in the link's stream: below this, striping cost more
than it bought here (2 cores; ``tcp_floor.py``: equal at 16 MB, slower at 4 MB)."""
CHUNK: Final = 4 << 20
"""Bytes in one piece of a striped buffer (the prefault thread's piece, too)."""
DEFAULT_STRIPES: Final = 2
"""Side connections per tcp link (two streams measured twice one; four no better on 2 cores)."""
MAX_STRIPES: Final = 16
FINISHED_KEPT: Final = 4096
"""Keys of buffers received whole and claimed, remembered to refuse them again."""
STRIPES_SETUP_TIMEOUT: Final = 2.0
"""Seconds (at most ``handshake_timeout``) a link's side connections may take to be up
once the link is: the first message with a large buffer waits for them that long at
most (a firewall that drops the side port's packets), then goes through the link."""
HEADER: Final = struct.Struct("<QQQQ")  # key, the buffer's bytes, offset, piece length
HELLO: Final = struct.Struct("<4s32sH32s")  # magic, link id, index, the dialer's proof
ACK: Final = struct.Struct("<4s32s")  # magic, the listener's proof
MAGIC: Final = b"ARS1"
GREETINGS_AT_ONCE: Final = 64
"""Unproven side connections being read at once; more are closed at once."""

Prove = Callable[[bool, int], bytes]
"""``prove(dialer, index)``: the HMAC a side connection's dialer (or listener) sends."""


def is_striped(key: int) -> bool:
    """Whether an ``ExternalRef`` key names a striped buffer."""
    return key & STRIPE_KEY != 0


class StripedParts(list[bytes | memoryview]):
    """A message's byte parts, the buffers (by key) that leave on side connections when
    it is written, and how to encode it all for the link's stream instead (``inline``:
    the side connections failed before it left)."""

    def __init__(
        self,
        parts: list[bytes | memoryview],
        stripes: list[tuple[int, memoryview]],
        inline: Callable[[], list[bytes | memoryview]],
    ) -> None:
        super().__init__(parts)
        self.stripes = stripes
        self.inline = inline


class StripeEvents(Protocol):
    """What side connections report to their link, on its loop's thread."""

    def stripes_ready(self) -> None: ...
    def stripe_arrived(self, key: int) -> None: ...
    def stripes_sent(self) -> None: ...
    def stripes_failed(self, exc: BaseException) -> None: ...


@dataclass(slots=True)
class _Incoming:
    """A striped buffer being received: its storage, the bytes still missing."""

    owner: Any
    view: memoryview
    missing: int
    claimed: bool = False
    offsets: set[int] = field(default_factory=set)  # of the pieces received


class Stripes:
    """One link's side connections (see the module docstring).  ``allocate``: storage
    for a received buffer; ``max_bytes``: the largest buffer accepted; ``call_soon``:
    runs a callback on the link's loop thread (``loop.call_soon_threadsafe``);
    ``confirmed=False`` (the listener's): buffers are sent only once confirmed (``confirm``)."""

    def __init__(
        self,
        count: int,
        events: StripeEvents,
        call_soon: Callable[..., object],
        *,
        prove: Prove,
        allocate: Allocator,
        max_bytes: int,
        silence_timeout: float,
        name: str,
        confirmed: bool = True,
    ) -> None:
        self.count = count
        self._events = events
        self._call_soon = call_soon
        self._prove = prove
        self._allocate = allocate
        self._max_bytes = max_bytes
        self._silence_timeout = silence_timeout
        self._name = name
        self._lock = threading.Lock()
        self._sockets: dict[int, socket.socket] = {}
        self._taken: set[int] = set()  # indexes a HELLO proved (listener side)
        self._finished: deque[int] = deque(maxlen=FINISHED_KEPT)  # keys claimed and in
        self._outboxes: list[queue.SimpleQueue[tuple[bytes, memoryview] | None]] = []
        self._incoming: dict[int, _Incoming] = {}
        self._keys = 0
        self.sending = 0  # pieces handed to sender threads, not sent yet (loop thread)
        self._attached = False  # every side connection is up here (loop thread)
        self._confirmed = confirmed
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- setting up ----------------------------------------------------------------

    def dial(self, host: str, port: int, link_id: bytes, timeout: float) -> None:
        """Connect every side connection (the link's dialer), on a thread of its own."""
        _start(f"asyncrpc-stripes-dial-{self._name}", self._dial_all, host, port, link_id, timeout)

    def _dial_all(self, host: str, port: int, link_id: bytes, timeout: float) -> None:
        try:
            for index in range(self.count):
                sock = socket.create_connection((host, port), timeout=timeout)
                try:
                    sock.sendall(HELLO.pack(MAGIC, link_id, index, self._prove(True, index)))
                    magic, proof = ACK.unpack(_recv_exactly(sock, ACK.size))
                    if magic != MAGIC or not hmac.compare_digest(proof, self._prove(False, index)):
                        raise ConnectionError("the side connection's listener failed its proof")
                except BaseException:
                    sock.close()
                    raise
                self.attach(index, sock)
        except OSError as exc:
            log.info("%s: no side connections (%s)", self._name, exc)
            self._failed(exc)

    def accepts(self, index: int, proof: bytes) -> bool:
        """Whether a HELLO's ``index`` and ``proof`` are this link's dialer's, for an index
        not taken yet; if so, it is taken (``attach`` follows the ACK)."""
        if not (0 <= index < self.count and hmac.compare_digest(proof, self._prove(True, index))):
            return False
        with self._lock:
            if index in self._taken or self.closed:
                return False
            self._taken.add(index)
            return True

    def listener_proof(self, index: int) -> bytes:
        return self._prove(False, index)

    def attach(self, index: int, sock: socket.socket) -> None:
        """A proven side connection (any thread); once all are, their readers start."""
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        detect_silence(sock, self._silence_timeout)
        with self._lock:
            if self.closed or index in self._sockets:
                sock.close()
                return
            self._sockets[index] = sock
            complete = len(self._sockets) == self.count
        if complete:
            self._call_soon(self._all_attached)

    def _all_attached(self) -> None:
        """Start a reader per side connection (a sender starts with the first send)."""
        with self._lock:
            if self.closed:
                return
            sockets = [self._sockets[index] for index in range(self.count)]
        for index, sock in enumerate(sockets):
            _start(f"asyncrpc-stripe-{self._name}-{index}", self._read, sock)
        self._attached = True
        if self._confirmed:
            self._events.stripes_ready()

    def confirm(self) -> None:
        """The dialer said its side connections are all up (loop thread; see ``ready``)."""
        self._confirmed = True
        if self._attached and not self.closed:
            self._events.stripes_ready()

    @property
    def ready(self) -> bool:
        """Whether buffers may be sent: every side connection is up here and, on the
        listener's side, the dialer confirmed it (``confirm``)."""
        return self._attached and self._confirmed and not self.closed

    # -- sending -------------------------------------------------------------------

    def next_key(self) -> int:
        """A key for the next striped buffer sent (any thread)."""
        with self._lock:
            self._keys += 1
            return STRIPE_KEY | self._keys

    def send(self, stripes: list[tuple[int, memoryview]]) -> None:
        """Hand each buffer's pieces to the sender threads, round-robin (loop thread)."""
        if self.closed or not (self._outboxes or self._start_senders()):
            return  # the link is being dropped
        turn = 0
        for key, buffer in stripes:
            data = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
            size = piece_size(data.nbytes, self.count)
            for offset in range(0, data.nbytes, size):
                piece = data[offset : offset + size]
                header = HEADER.pack(key, data.nbytes, offset, piece.nbytes)
                self._outboxes[turn % self.count].put((header, piece))
                self.sending += 1
                turn += 1

    def _start_senders(self) -> bool:
        """A sender thread per side connection, each with its outbox; False if closed.
        (Started on first use: a link that never sends a large buffer keeps half the
        threads.)"""
        with self._lock:
            if self.closed:
                return False
            self._outboxes = [queue.SimpleQueue() for _ in range(self.count)]
            for index, outbox in enumerate(self._outboxes):
                sock = self._sockets[index]
                _start(f"asyncrpc-stripe-{self._name}-{index}", self._write, sock, outbox)
        return True

    def _write(self, sock: socket.socket, outbox: queue.SimpleQueue[Any]) -> None:
        try:
            while (job := outbox.get()) is not None:
                header, piece = job
                sock.sendall(header)
                sock.sendall(piece)
                nbytes = len(header) + piece.nbytes
                del job, piece
                with self._lock:
                    self.bytes_sent += nbytes
                self._call_soon(self._piece_sent)
        except BaseException as exc:
            self._failed(exc)

    def _piece_sent(self) -> None:
        self.sending -= 1
        if self.sending == 0:
            self._events.stripes_sent()

    # -- receiving -----------------------------------------------------------------

    def claim(self, key: int, nbytes: int) -> tuple[Any, bool]:
        """The storage of the striped buffer ``key`` for a received message (loop thread),
        and whether all of it has arrived."""
        with self._lock:
            incoming = self._incoming_buffer(key, nbytes)
            if incoming.claimed:
                raise RemoteProtocolError(f"striped buffer {key & ~STRIPE_KEY} claimed twice")
            incoming.claimed = True
            arrived = incoming.missing == 0
            if arrived:
                self._finish(key)
            return incoming.owner, arrived

    def _finish(self, key: int) -> None:
        """A buffer is claimed and in: forget it, but refuse its key from now on."""
        del self._incoming[key]
        self._finished.append(key)

    def _incoming_buffer(self, key: int, nbytes: int) -> _Incoming:
        """The buffer ``key`` names, made if new (under the lock)."""
        incoming = self._incoming.get(key)
        if incoming is None:
            if not is_striped(key):
                raise RemoteProtocolError(f"key {key:#x} of a striped buffer lacks its bit")
            if key in self._finished:
                number = key & ~STRIPE_KEY
                raise RemoteProtocolError(f"striped buffer {number} claimed twice (it came whole)")
            if not 0 < nbytes <= self._max_bytes:
                raise RemoteProtocolError(
                    f"striped buffer of {nbytes} bytes (max_frame_size {self._max_bytes})"
                )
            owner, view = self._allocate(nbytes)
            incoming = self._incoming[key] = _Incoming(owner, view, nbytes)
        elif incoming.view.nbytes != nbytes:
            raise RemoteProtocolError(
                f"striped buffer {key & ~STRIPE_KEY} said to hold {nbytes} bytes and "
                f"{incoming.view.nbytes}"
            )
        return incoming

    def _read(self, sock: socket.socket) -> None:
        try:
            while True:
                key, total, offset, length = HEADER.unpack(_recv_exactly(sock, HEADER.size))
                with self._lock:
                    incoming = self._incoming_buffer(key, total)
                    self._check_piece(incoming, offset, length)
                piece = incoming.view[offset : offset + length]
                fault_in(piece)  # in bulk, ahead of the socket, if fresh
                _recv_into_exactly(sock, piece)
                del piece
                with self._lock:
                    self.bytes_received += HEADER.size + length
                    incoming.missing -= length
                    arrived = incoming.missing == 0
                    if arrived and incoming.claimed:
                        self._finish(key)
                if arrived:
                    self._call_soon(self._arrived, key)
                del incoming
        except BaseException as exc:
            self._failed(exc)

    def _check_piece(self, incoming: _Incoming, offset: int, length: int) -> None:
        """A piece must be one of its buffer's (``piece_size``), and new (under the lock)."""
        total = incoming.view.nbytes
        size = piece_size(total, self.count)
        if offset % size or offset >= total or length != min(size, total - offset):
            raise RemoteProtocolError(
                f"striped piece [{offset}, {offset + length}) outside its buffer of "
                f"{total} bytes (in pieces of {size})"
            )
        if offset in incoming.offsets:
            raise RemoteProtocolError(f"striped piece at {offset} received twice")
        incoming.offsets.add(offset)

    def _arrived(self, key: int) -> None:
        if not self.closed:
            self._events.stripe_arrived(key)

    # -- ending --------------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        """A side connection failed (any thread): the link hears of it, unless closing."""
        if not self.closed:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
                self._call_soon(self._fail, exc)

    def _fail(self, exc: BaseException) -> None:
        if not self.closed:
            self._events.stripes_failed(exc)

    def close(self) -> None:
        """Close every side connection now (any thread); buffers in flight are dropped."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            sockets, self._sockets = list(self._sockets.values()), {}
            self._incoming.clear()
            outboxes = self._outboxes
        for outbox in outboxes:
            outbox.put(None)
        for sock in sockets:
            with contextlib.suppress(OSError):  # not connected any more
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class StripeListener:
    """Where a worker's tcp links' side connections arrive: a listening socket on the
    tcp listen host, its own port, a thread accepting on it.  A connection is read for
    its HELLO (a bounded time, ``GREETINGS_AT_ONCE`` at most at once) and handed to the
    link it proves it belongs to (``expect``), or closed."""

    def __init__(self, host: str, count: int = DEFAULT_STRIPES, *, timeout: float = 10.0):
        if not 1 <= count <= MAX_STRIPES:
            raise ValueError(f"tcp_stripes must be 1 to {MAX_STRIPES} for a listener, not {count}")
        self.count = count
        self._timeout = timeout
        self._sock = socket.create_server((host, 0), family=_family(host), backlog=128)
        self.port: int = self._sock.getsockname()[1]
        self._expected: dict[bytes, Stripes] = {}
        self._lock = threading.Lock()
        self._greeting = threading.BoundedSemaphore(GREETINGS_AT_ONCE)
        self._closed = False
        _start("asyncrpc-stripes-accept", self._accept)

    def expect(self, link_id: bytes, stripes: Stripes) -> None:
        """Hand side connections that prove they are of ``link_id`` to ``stripes``."""
        with self._lock:
            self._expected[link_id] = stripes

    def forget(self, link_id: bytes) -> None:
        with self._lock:
            self._expected.pop(link_id, None)

    def close(self) -> None:
        """Stop accepting (connections being greeted are closed by their threads)."""
        self._closed = True
        with contextlib.suppress(OSError):  # (wakes a thread blocked in accept)
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue  # ECONNABORTED and the like: the next one
            if not self._greeting.acquire(blocking=False):
                sock.close()
                continue
            _start("asyncrpc-stripes-greet", self._greet, sock)

    def _greet(self, sock: socket.socket) -> None:
        """Read a HELLO within the timeout; attach the connection to its link, or close it."""
        try:
            sock.settimeout(self._timeout)
            magic, link_id, index, proof = HELLO.unpack(_recv_exactly(sock, HELLO.size))
            with self._lock:
                stripes = self._expected.get(link_id)
            if magic != MAGIC or stripes is None or not stripes.accepts(index, proof):
                raise ConnectionError("a side connection failed its proof")
            sock.sendall(ACK.pack(MAGIC, stripes.listener_proof(index)))
            stripes.attach(index, sock)
        except (OSError, struct.error) as exc:
            log.info("refused a side connection: %s", exc)
            sock.close()
        finally:
            self._greeting.release()


def piece_size(nbytes: int, count: int) -> int:
    """Bytes in each piece of a striped buffer of ``nbytes`` (the last may be shorter):
    ``CHUNK``, or less so that each of ``count`` connections has one."""
    return max(1, min(CHUNK, -(-nbytes // count)))


def _start(name: str, target: Callable[..., object], *args: Any) -> None:
    """Run ``target(*args)`` on a new daemon thread named ``name``."""
    threading.Thread(target=target, args=args, daemon=True, name=name).start()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    _recv_into_exactly(sock, memoryview(data))
    return bytes(data)


def _recv_into_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``: one system call unless a signal interrupts it
    (``MSG_WAITALL``), so a reader takes the GIL once a piece, not once a packet burst."""
    while view.nbytes:
        got = sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
        if got == 0:
            raise ConnectionError("the side connection was closed")
        view = view[got:]
