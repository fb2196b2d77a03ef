"""Sans-IO frame codec: bytes in, frames out; frames in, byte parts out.

Theory of operation
-------------------
One message on the wire is one *frame*::

    prelude   8 bytes   magic (u16) | flags (u16, zero) | header length (u32)
    header    msgpack   [kind, meta, payload length, buffer descriptors]
    payload   bytes     the pickle stream (tensor storages left out of band)
    buffers   bytes     each inline buffer, back to back, in descriptor order

A buffer descriptor is an ``int`` (an inline buffer of that many bytes that
follows the payload) or ``[key, nbytes]`` (an :class:`ExternalRef`: the bytes
travel some other way, e.g. a shared-memory segment, and an upper layer resolves
the key).

The decoder has two faces.  ``get_buffer()``/``buffer_updated(n)`` is what an
``asyncio.BufferedProtocol`` calls, so the kernel writes straight into memory
the decoder chose: a small staging area for preludes, headers and small
payloads, and, for a large buffer, the destination object itself (made by the
injected ``allocate`` callable, e.g. fresh tensor storage).  ``receive_data()``
feeds scripted chunks through that same path, for tests.  ``next_event()`` then
returns one complete :class:`Frame` or ``NEED_DATA``.  Any violation (bad magic,
malformed header, a length above the limits, an unknown or unwelcome kind) raises
``RemoteProtocolError`` and poisons the decoder: the connection must be dropped.

Limits before trust.  What a decoder accepts is its :class:`Limits`: the kinds,
the header length and the body length (payload plus every buffer, external ones
included).  The prelude is checked before the header is staged, the header
before any body byte is allocated, so nothing is ever allocated above the
current limits.  A connection starts under ``HANDSHAKE_LIMITS``: handshake
kinds only, no body, the whole frame at most ``MAX_HANDSHAKE_FRAME`` bytes, in a
staging area of that size.  Once the peer is authenticated, its owner assigns
:meth:`Limits.established` (``max_frame_size``, every other kind); new limits
apply from the next frame whose header is not parsed yet, and the staging area
grows to ``STAGING_SIZE`` then.  The fast path reads the limits from plain
attributes where it read constants before: it costs established links nothing.
A poisoned decoder hands out no frame, not even one parsed before the error.

No asyncio, no sockets, nothing but bytes: every split point is testable.
"""

from __future__ import annotations

import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from asyncrpc.errors import LocalProtocolError, RemoteProtocolError
from asyncrpc.wire.messages import ESTABLISHED_KINDS, HANDSHAKE_KINDS, KNOWN_KINDS, Kind

MAGIC: Final = 0xA5C1
PRELUDE: Final = struct.Struct("<HHI")
MAX_HEADER_SIZE: Final = 64 * 1024
DEFAULT_MAX_FRAME_SIZE: Final = 8 * 1024**3
STAGING_SIZE: Final = 256 * 1024
SMALL_STAGING: Final = 4 * 1024
MAX_HANDSHAKE_FRAME: Final = SMALL_STAGING
"""Bytes in a whole frame (prelude and header; it has no body) before the handshake
completes: it fits in the small staging area."""
SMALL_PAYLOAD: Final = 64 * 1024


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()
"""Returned by :meth:`FrameDecoder.next_event` when no whole frame is buffered yet."""


@dataclass(frozen=True, slots=True)
class ExternalRef:
    """A buffer whose bytes travel outside the stream, named by ``key``."""

    key: int
    nbytes: int


@dataclass(slots=True)
class Frame:
    """One decoded message.  ``buffers`` holds allocator objects or ExternalRefs."""

    kind: int
    meta: dict[str, Any]
    payload: bytes | bytearray = b""
    buffers: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a decoder accepts: which kinds, how long a header, how large a body (the
    payload plus every buffer, external ones included).  ``stage`` ends error messages
    ("before the handshake completes")."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_header_size: int = MAX_HEADER_SIZE
    kinds: frozenset[int] = KNOWN_KINDS
    stage: str = ""

    def __post_init__(self) -> None:
        if not (0 <= self.max_header_size <= MAX_HEADER_SIZE and self.max_frame_size >= 0):
            raise ValueError(f"invalid frame limits {self!r}")
        if not self.kinds <= KNOWN_KINDS:
            raise ValueError(f"unknown kinds in {sorted(self.kinds - KNOWN_KINDS)}")

    @staticmethod
    def established(max_frame_size: int) -> Limits:
        """An authenticated connection's: bodies up to ``max_frame_size``, no handshake."""
        return Limits(max_frame_size, kinds=ESTABLISHED_KINDS, stage="after the handshake")

    @property
    def staging_size(self) -> int:
        """``SMALL_STAGING`` when a whole frame fits in it, else ``STAGING_SIZE``, which
        holds any header and any small payload (and many small frames per read)."""
        whole = PRELUDE.size + self.max_header_size + self.max_frame_size
        return SMALL_STAGING if whole <= SMALL_STAGING else STAGING_SIZE


HANDSHAKE_LIMITS: Final = Limits(
    max_frame_size=0,
    max_header_size=MAX_HANDSHAKE_FRAME - PRELUDE.size,
    kinds=HANDSHAKE_KINDS,
    stage="before the handshake completes",
)
"""An unauthenticated connection's: handshake frames only, msgpack headers of a few KB."""
DEFAULT_LIMITS: Final = Limits()


Allocator = Callable[[int], tuple[Any, memoryview]]
"""``allocate(nbytes) -> (owner, writable byte view of exactly nbytes)``."""


def allocate_bytearray(nbytes: int) -> tuple[Any, memoryview]:
    """Default allocator: a plain ``bytearray``."""
    buf = bytearray(nbytes)
    return buf, memoryview(buf)


def encode_frame(
    kind: int,
    meta: dict[str, Any],
    payload: bytes | memoryview = b"",
    buffers: Sequence[memoryview | ExternalRef] = (),
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
) -> list[bytes | memoryview]:
    """Encode one frame as a list of parts for ``transport.writelines``.

    Inline buffers are passed through as they are (no copy); they must be
    byte-format memoryviews so that ``len()`` is their size in bytes.
    """
    descriptors: list[int | list[int]] = []
    inline: list[memoryview] = []
    for buf in buffers:
        if isinstance(buf, ExternalRef):
            descriptors.append([buf.key, buf.nbytes])
        else:
            descriptors.append(buf.nbytes)
            inline.append(buf)
    total = len(payload) + sum(b.nbytes for b in buffers)
    if total > max_frame_size:
        raise LocalProtocolError(
            f"frame of {total} bytes exceeds the maximum frame size of {max_frame_size} bytes"
        )
    header = _packer().pack([kind, meta, len(payload), descriptors])
    if len(header) > MAX_HEADER_SIZE:
        raise LocalProtocolError(
            f"its frame header would take {len(header)} bytes ({len(descriptors)} buffers), "
            f"more than the {MAX_HEADER_SIZE} a header holds",
            header_bytes=len(header),
        )
    head = PRELUDE.pack(MAGIC, 0, len(header)) + header
    if len(payload) <= SMALL_PAYLOAD:
        return [head + payload, *inline]
    return [head, payload, *inline]


BATCH: Final = int(Kind.BATCH)
BATCHED_PAYLOAD_MAX: Final = 1024
"""Bytes: a message without buffers whose payload is no larger may travel as an entry of a
BATCH frame (a burst's small messages; see :func:`encode_batch`)."""


def encode_entry(kind: int, meta: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    """One small message (no buffers) as an entry of a BATCH frame: ``[kind, meta,
    payload]`` in msgpack.  Raises what msgpack raises for a meta it cannot pack."""
    entry: bytes = _packer().pack([kind, meta, payload])
    return entry


def encode_batch(entries: Sequence[bytes]) -> bytes:
    """One BATCH frame carrying ``entries`` (from :func:`encode_entry`), in order: its
    payload is a msgpack array whose items are the entries as they are, so nothing is
    packed twice.  The receiver hands each entry up as a frame of its own
    (:func:`split_batch`): a burst of small messages costs one frame's prelude, header
    and parse."""
    payload = b"".join([_packer().pack_array_header(len(entries)), *entries])
    return b"".join(encode_frame(BATCH, {}, payload))  # (a batch is small: one part)


def split_batch(payload: bytes | bytearray, kinds: frozenset[int]) -> list[Frame]:
    """The frames a BATCH frame's ``payload`` carries, in order; ``RemoteProtocolError``
    unless it is a non-empty array of ``[kind, meta, payload]`` entries whose kinds are
    among ``kinds`` (what the decoder accepts now), none of them BATCH."""
    try:
        entries = msgpack.unpackb(payload, raw=False, use_list=True)
    except Exception as exc:
        raise RemoteProtocolError(f"undecodable BATCH frame: {exc}") from exc
    if type(entries) is not list or not entries:
        raise RemoteProtocolError("BATCH frame is not a non-empty array of entries")
    frames = []
    for entry in entries:
        if type(entry) is not list or len(entry) != 3:
            raise RemoteProtocolError("BATCH entry is not a 3-item array")
        kind, meta, body = entry
        if type(kind) is not int or kind not in kinds or kind == BATCH:
            raise RemoteProtocolError(f"message kind {kind!r} not allowed in a BATCH frame")
        if type(meta) is not dict or type(body) is not bytes:
            raise RemoteProtocolError("malformed BATCH entry fields")
        frames.append(Frame(kind, meta, body, []))
    return frames


_local = threading.local()


def _packer() -> msgpack.Packer:
    """One Packer per thread: ``msgpack.packb`` would allocate a 1 MiB buffer per call."""
    packer: msgpack.Packer | None = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


@dataclass(slots=True)
class _Partial:
    """A frame whose header is parsed and whose body is still arriving."""

    frame: Frame
    payload_len: int
    pending: list[tuple[int, int]]  # (buffer index, size) of inline buffers still to read
    payload_done: bool = False


class FrameDecoder:
    """Incremental frame decoder; see the module docstring."""

    def __init__(
        self, limits: Limits = DEFAULT_LIMITS, *, allocate: Allocator = allocate_bytearray
    ) -> None:
        self._allocate = allocate
        self._staging = bytearray(limits.staging_size)
        self._view = memoryview(self._staging)
        self._start = 0  # first unparsed staged byte
        self._end = 0  # one past the last staged byte
        self._partial: _Partial | None = None
        self._direct: memoryview | None = None  # destination being filled by the kernel
        self._direct_filled = 0
        self._ready: deque[Frame] = deque()
        self._error: RemoteProtocolError | None = None
        self.limits = limits

    @property
    def limits(self) -> Limits:
        """What is accepted.  Assigning applies to every frame whose header is not
        parsed yet, and grows the staging area if the new limits want a larger one."""
        return self._limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        self._limits = limits
        # Read on the fast path: plain attributes, one lookup each.
        self._kinds = limits.kinds
        self._max_header = limits.max_header_size
        self._small_body = min(SMALL_PAYLOAD, limits.max_frame_size)
        if limits.staging_size > len(self._staging):
            self._grow(limits.staging_size)

    @property
    def staging_size(self) -> int:
        """Bytes of staging memory this decoder holds."""
        return len(self._staging)

    # -- the BufferedProtocol face -------------------------------------------------

    def get_buffer(self) -> memoryview:
        """Writable memory for the next bytes from the peer (never empty)."""
        if self._direct is not None:
            return self._direct[self._direct_filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._staging) - self._end < 4096:
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the last ``get_buffer()``."""
        if self._direct is not None:
            self._direct_filled += nbytes
        else:
            self._end += nbytes

    def receive_data(self, data: bytes | memoryview) -> None:
        """Feed a chunk of bytes (the scripted face, for tests and simple shells)."""
        view = memoryview(data).cast("B")
        while view:
            target = self.get_buffer()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]
            # Parse as we go, so that staged bytes move on into their destinations.
            while not isinstance(frame := self._guarded_advance(), _NeedData):
                self._ready.append(frame)

    def next_event(self) -> Frame | _NeedData:
        """Return the next complete frame, or ``NEED_DATA``."""
        if self._ready and self._error is None:  # poisoned: frames parsed before it too
            return self._ready.popleft()
        return self._guarded_advance()

    def _guarded_advance(self) -> Frame | _NeedData:
        """``_advance``, poisoning the decoder on a protocol error (a method of its own,
        not a wrapper taking ``_advance``: no bound method made on every frame's path)."""
        if self._error is not None:
            raise self._error
        try:
            return self._advance()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    # -- parsing -------------------------------------------------------------------

    def _advance(self) -> Frame | _NeedData:
        if self._partial is None and self._direct is None:
            frame = self._small_frame()
            if frame is not None:
                return frame
        self._drain_direct()
        if self._direct is not None:
            return NEED_DATA
        if self._partial is None and not self._parse_header():
            return NEED_DATA
        assert self._partial is not None
        if not self._read_body(self._partial):
            return NEED_DATA
        frame, self._partial = self._partial.frame, None
        return frame

    def _small_frame(self) -> Frame | None:
        """Fast path for the common case: a whole small frame is staged, its buffers (if
        any) inline.  They are copied into freshly allocated buffers here.

        Anything else (incomplete, large, external buffers, or invalid) returns None and
        takes the general path, which also produces every error.
        """
        start, end = self._start, self._end
        if end - start < PRELUDE.size:
            return None
        magic, flags, header_len = PRELUDE.unpack_from(self._staging, start)
        header_end = start + PRELUDE.size + header_len
        if magic != MAGIC or flags or header_len > self._max_header or header_end > end:
            return None
        try:
            header = msgpack.unpackb(self._view[start + PRELUDE.size : header_end])
        except Exception:
            return None
        if type(header) is not list or len(header) != 4:
            return None
        kind, meta, size, descriptors = header
        if (
            type(size) is not int
            or type(meta) is not dict
            or type(kind) is not int
            or kind not in self._kinds
            or type(descriptors) is not list
            or (descriptors and not all(type(d) is int and d >= 0 for d in descriptors))
        ):
            return None
        body_end = header_end + size + (sum(descriptors) if descriptors else 0)
        if not 0 <= size <= body_end - header_end <= self._small_body:
            return None
        if body_end > end:
            return None
        at = header_end + size
        frame = Frame(kind, meta, self._staging[header_end:at], [])
        for nbytes in descriptors:
            owner, view = self._allocate(nbytes)
            view[:] = self._view[at : at + nbytes]
            frame.buffers.append(owner)
            at += nbytes
        self._start = at
        return frame

    def _drain_direct(self) -> None:
        if self._direct is not None and self._direct_filled == len(self._direct):
            self._direct, self._direct_filled = None, 0

    def _staged(self) -> int:
        return self._end - self._start

    def _parse_header(self) -> bool:
        if self._staged() < PRELUDE.size:
            return False
        magic, flags, header_len = PRELUDE.unpack_from(self._staging, self._start)
        if magic != MAGIC or flags != 0:
            raise RemoteProtocolError(f"bad frame prelude (magic {magic:#06x}, flags {flags})")
        if header_len > self._max_header:
            raise RemoteProtocolError(
                f"frame header of {header_len} bytes exceeds {self._max_header}{self._stage()}"
            )
        if self._staged() < PRELUDE.size + header_len:
            return False
        begin = self._start + PRELUDE.size
        self._partial = self._validate_header(self._view[begin : begin + header_len])
        self._start = begin + header_len
        return True

    def _validate_header(self, raw: memoryview) -> _Partial:
        try:
            header = msgpack.unpackb(raw, raw=False, use_list=True)
        except Exception as exc:
            raise RemoteProtocolError(f"undecodable frame header: {exc}") from exc
        if type(header) is not list or len(header) != 4:
            raise RemoteProtocolError("frame header is not a 4-item array")
        kind, meta, payload_len, descriptors = header
        if type(kind) is not int or kind not in KNOWN_KINDS:
            raise RemoteProtocolError(f"unknown message kind {kind!r}")
        if kind not in self._kinds:
            raise RemoteProtocolError(f"{Kind(kind).name} frame not allowed{self._stage()}")
        if type(meta) is not dict or type(descriptors) is not list:
            raise RemoteProtocolError("malformed frame header fields")
        sizes = [payload_len, *[self._descriptor_size(d) for d in descriptors]]
        if not all(type(s) is int and s >= 0 for s in sizes):
            raise RemoteProtocolError(f"invalid lengths in frame header: {sizes!r}")
        if sum(sizes) > self._limits.max_frame_size:
            raise RemoteProtocolError(
                f"frame of {sum(sizes)} bytes exceeds the maximum frame size "
                f"of {self._limits.max_frame_size} bytes{self._stage()}"
            )
        buffers: list[Any] = [None] * len(descriptors)
        pending: list[tuple[int, int]] = []
        for i, d in enumerate(descriptors):
            if isinstance(d, int):
                pending.append((i, d))
            else:
                buffers[i] = ExternalRef(d[0], d[1])
        pending.reverse()  # popped from the end, in order
        return _Partial(Frame(kind, meta, b"", buffers), payload_len, pending)

    @staticmethod
    def _descriptor_size(d: Any) -> Any:
        if isinstance(d, int):
            return d
        if isinstance(d, list) and len(d) == 2 and all(isinstance(x, int) for x in d):
            return d[1]
        raise RemoteProtocolError(f"malformed buffer descriptor {d!r}")

    def _read_body(self, part: _Partial) -> bool:
        if not part.payload_done and not self._read_payload(part):
            return False
        while part.pending:
            index, size = part.pending[-1]
            owner, view = self._allocate(size)
            part.frame.buffers[index] = owner
            part.pending.pop()
            if not self._fill(view):
                return False
        return True

    def _read_payload(self, part: _Partial) -> bool:
        size = part.payload_len
        if size <= SMALL_PAYLOAD:
            if self._staged() < size:
                if self._start + size > len(self._staging):
                    self._compact()
                return False
            part.frame.payload = bytes(self._view[self._start : self._start + size])
            self._start += size
            part.payload_done = True
            return True
        part.frame.payload = buf = bytearray(size)
        part.payload_done = True
        return self._fill(memoryview(buf))

    def _fill(self, view: memoryview) -> bool:
        """Copy what is staged into ``view``; hand the rest to the kernel directly."""
        n = min(self._staged(), len(view))
        view[:n] = self._view[self._start : self._start + n]
        self._start += n
        if n == len(view):
            return True
        self._direct, self._direct_filled = view, n
        return False

    def _stage(self) -> str:
        return f" {self._limits.stage}" if self._limits.stage else ""

    def _grow(self, size: int) -> None:
        staged = self._staged()
        grown = bytearray(size)
        grown[:staged] = self._view[self._start : self._end]
        self._staging, self._view = grown, memoryview(grown)
        self._start, self._end = 0, staged

    def _compact(self) -> None:
        staged = self._staged()
        self._view[:staged] = self._view[self._start : self._end]
        self._start, self._end = 0, staged
