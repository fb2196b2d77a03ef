"""Unit tests for the sans-IO frame codec (asyncrpc.wire.codec).

Every test here drives the codec with bytes only: no sockets, no event loop.
"""

from __future__ import annotations

import ctypes
import itertools
import random
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrpc._compiled import is_compiled
from asyncrpc.errors import LocalProtocolError, RemoteProtocolError
from asyncrpc.wire import codec
from asyncrpc.wire.codec import (
    HANDSHAKE_LIMITS,
    MAGIC,
    MAX_HANDSHAKE_FRAME,
    MAX_HEADER_SIZE,
    NEED_DATA,
    PRELUDE,
    SMALL_PAYLOAD,
    SMALL_STAGING,
    STAGING_SIZE,
    ExternalRef,
    Frame,
    FrameDecoder,
    Limits,
    allocate_bytearray,
    encode_frame,
)
from asyncrpc.wire.messages import ESTABLISHED_KINDS, HANDSHAKE_KINDS, KNOWN_KINDS, Kind

# -- helpers ---------------------------------------------------------------------------


def pattern(n: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating-looking bytes (so misplaced bytes are caught)."""
    return random.Random(seed * 1_000_003 + n).randbytes(n)


class Spec:
    """What a frame should look like: the input of encode_frame, the expected output."""

    def __init__(
        self,
        kind: int,
        meta: dict[str, Any],
        payload: bytes = b"",
        buffers: list[bytes | ExternalRef] | None = None,
    ) -> None:
        self.kind = kind
        self.meta = meta
        self.payload = payload
        self.buffers = buffers or []

    def encode(self, **kwargs: Any) -> bytes:
        parts = encode_frame(
            self.kind,
            self.meta,
            self.payload,
            [b if isinstance(b, ExternalRef) else memoryview(b) for b in self.buffers],
            **kwargs,
        )
        return b"".join(bytes(p) for p in parts)

    def check(self, frame: Any) -> None:
        assert isinstance(frame, Frame)
        assert frame.kind == self.kind
        assert frame.meta == self.meta
        assert bytes(frame.payload) == self.payload
        assert len(frame.buffers) == len(self.buffers)
        for got, want in zip(frame.buffers, self.buffers, strict=True):
            if isinstance(want, ExternalRef):
                assert got == want
            else:
                assert not isinstance(got, ExternalRef)
                assert bytes(got) == want


def drain(decoder: FrameDecoder) -> list[Frame]:
    out: list[Frame] = []
    while (event := decoder.next_event()) is not NEED_DATA:
        assert isinstance(event, Frame)
        out.append(event)
    return out


def feed_chunks(data: bytes, cuts: list[int], **kwargs: Any) -> list[Frame]:
    """Feed ``data`` through receive_data, cut at the given offsets; return every frame."""
    decoder = FrameDecoder(**kwargs)
    frames: list[Frame] = []
    bounds = [0, *sorted(cuts), len(data)]
    for lo, hi in itertools.pairwise(bounds):
        decoder.receive_data(data[lo:hi])
        frames.extend(drain(decoder))
    assert decoder.next_event() is NEED_DATA
    return frames


def feed_buffered(
    decoder: FrameDecoder,
    data: bytes,
    rng: random.Random,
    max_chunk: int,
    on_write: Any = None,
) -> list[Frame]:
    """Drive the BufferedProtocol face as asyncio would: get_buffer, write, buffer_updated."""
    frames: list[Frame] = []
    pos = 0
    while pos < len(data):
        target = decoder.get_buffer()
        assert len(target) > 0, "get_buffer() returned an empty buffer"
        n = min(len(target), len(data) - pos, rng.randint(1, max_chunk))
        target[:n] = data[pos : pos + n]
        if on_write is not None:
            on_write(target, n)
        decoder.buffer_updated(n)
        pos += n
        frames.extend(drain(decoder))
    return frames


def raw_frame(header: Any, body: bytes = b"", *, magic: int = MAGIC, flags: int = 0) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return PRELUDE.pack(magic, flags, len(packed)) + packed + body


def address_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class RecordingAllocator:
    """An allocator that remembers every object it handed out (and its address)."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.objects: list[bytearray] = []
        self.ranges: list[tuple[int, int]] = []

    def __call__(self, nbytes: int) -> tuple[Any, memoryview]:
        self.calls.append(nbytes)
        owner, view = allocate_bytearray(nbytes)
        self.objects.append(owner)
        if nbytes:
            start = address_of(view)
            self.ranges.append((start, start + nbytes))
        return owner, view


REPRESENTATIVE = Spec(
    Kind.REQUEST,
    {"i": 7, "f": "module.function"},
    pattern(300, 1),
    [b"", pattern(100, 2), ExternalRef(5, 1 << 20), pattern(2000, 3), b""],
)

SMALL_FRAMES = [
    Spec(Kind.HELLO, {"v": 1, "name": "w0", "nonce": b"\x00" * 32}),
    Spec(Kind.RESPONSE, {"i": 1}, pattern(50, 4), [pattern(10, 5), b""]),
    Spec(Kind.RELEASE, {"k": [3, 4]}, b"", [ExternalRef(9, 123)]),
]

# -- round trips -----------------------------------------------------------------------

SIZES = [0, 1, 100, SMALL_PAYLOAD - 1, SMALL_PAYLOAD, SMALL_PAYLOAD + 1, STAGING_SIZE + 1, 1 << 20]


@pytest.mark.parametrize("payload_size", SIZES)
def test_round_trip_payload_sizes_one_chunk(payload_size: int) -> None:
    spec = Spec(Kind.RESPONSE, {"i": payload_size}, pattern(payload_size, 10))
    (frame,) = feed_chunks(spec.encode(), [])
    spec.check(frame)


@pytest.mark.parametrize("buffer_size", [0, 1, 4096, SMALL_PAYLOAD + 1, STAGING_SIZE + 1, 1 << 20])
def test_round_trip_buffer_sizes_one_chunk(buffer_size: int) -> None:
    spec = Spec(
        Kind.REQUEST,
        {"i": 1, "f": "f"},
        pattern(17, 11),
        [pattern(buffer_size, 12), b"", pattern(buffer_size, 13), ExternalRef(4, buffer_size)],
    )
    (frame,) = feed_chunks(spec.encode(), [])
    spec.check(frame)


def test_round_trip_large_payload_and_large_buffers_one_chunk() -> None:
    spec = Spec(
        Kind.RESPONSE,
        {"i": 2},
        pattern(STAGING_SIZE + 7, 14),
        [pattern(STAGING_SIZE + 3, 15), ExternalRef(1, 2), pattern(3, 16), pattern(1 << 20, 17)],
    )
    (frame,) = feed_chunks(spec.encode(), [])
    spec.check(frame)


def test_encode_frame_parts_pass_buffers_through_without_copy() -> None:
    buf = memoryview(bytearray(pattern(1000, 18)))
    big_payload = pattern(SMALL_PAYLOAD + 1, 19)
    parts = encode_frame(Kind.RESPONSE, {"i": 1}, big_payload, [buf])
    assert parts[-1] is buf
    assert parts[1] is big_payload  # a large payload is its own part, not concatenated
    small = encode_frame(Kind.RESPONSE, {"i": 1}, b"abc", [buf])
    assert len(small) == 2 and small[1] is buf


def test_round_trip_external_refs_only() -> None:
    pairs = [(0, 0), (3, 1), (2**40, 2**32)]
    refs: list[bytes | ExternalRef] = [ExternalRef(k, n) for k, n in pairs]
    spec = Spec(Kind.RESPONSE, {"i": 3}, b"payload", refs)
    allocator = RecordingAllocator()
    (frame,) = feed_chunks(spec.encode(), [], allocate=allocator)
    spec.check(frame)
    assert allocator.calls == []  # nothing inline: nothing allocated


def test_all_known_kinds_round_trip() -> None:
    specs = [Spec(kind, {"k": kind}, pattern(kind, kind)) for kind in sorted(KNOWN_KINDS)]
    frames = feed_chunks(b"".join(s.encode() for s in specs), [])
    assert len(frames) == len(specs)
    for spec, frame in zip(specs, frames, strict=True):
        spec.check(frame)


@pytest.mark.parametrize("index", range(len(SMALL_FRAMES)))
def test_small_frame_byte_by_byte(index: int) -> None:
    spec = SMALL_FRAMES[index]
    data = spec.encode()
    decoder = FrameDecoder()
    frames: list[Frame] = []
    for i in range(len(data)):
        decoder.receive_data(data[i : i + 1])
        got = drain(decoder)
        if i < len(data) - 1:
            assert got == [], f"frame emitted early, after byte {i}"
        frames.extend(got)
    assert len(frames) == 1
    spec.check(frames[0])


def test_representative_frame_byte_by_byte() -> None:
    data = REPRESENTATIVE.encode()
    frames = feed_chunks(data, list(range(1, len(data))))
    assert len(frames) == 1
    REPRESENTATIVE.check(frames[0])


def test_every_split_point_of_one_frame() -> None:
    data = REPRESENTATIVE.encode()
    for cut in range(len(data) + 1):
        frames = feed_chunks(data, [cut])
        assert len(frames) == 1, f"split at {cut}"
        REPRESENTATIVE.check(frames[0])


def test_every_split_point_of_three_frames_back_to_back() -> None:
    data = b"".join(s.encode() for s in SMALL_FRAMES)
    for cut in range(len(data) + 1):
        frames = feed_chunks(data, [cut])
        assert len(frames) == 3, f"split at {cut}"
        for spec, frame in zip(SMALL_FRAMES, frames, strict=True):
            spec.check(frame)


def test_boundary_split_points_of_a_large_frame() -> None:
    """Splits around every section boundary of a frame that uses the direct-write path."""
    payload = pattern(SMALL_PAYLOAD + 5, 20)
    bufs: list[bytes | ExternalRef] = [pattern(STAGING_SIZE + 9, 21), b"", pattern(33, 22)]
    spec = Spec(Kind.REQUEST, {"i": 9, "f": "g"}, payload, bufs)
    data = spec.encode()
    head = len(encode_frame(spec.kind, spec.meta, payload, [memoryview(b) for b in bufs])[0])
    boundaries = [0, PRELUDE.size, head, head + len(payload)]
    for b in bufs:
        boundaries.append(boundaries[-1] + len(b))
    boundaries.append(STAGING_SIZE)
    cuts = {c for b in boundaries for c in range(b - 6, b + 7) if 0 <= c <= len(data)}
    cuts |= set(range(0, len(data) + 1, 40_009))
    for cut in sorted(cuts):
        frames = feed_chunks(data, [cut])
        assert len(frames) == 1, f"split at {cut}"
        spec.check(frames[0])


# -- the BufferedProtocol face ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_buffered_protocol_face_random_chunks(seed: int) -> None:
    rng = random.Random(seed)
    specs = [
        REPRESENTATIVE,
        *SMALL_FRAMES,
        Spec(Kind.RESPONSE, {"i": 5}, pattern(STAGING_SIZE + 1, 30), [pattern(SMALL_PAYLOAD, 31)]),
        Spec(Kind.ERROR, {"i": 6}, pattern(SMALL_PAYLOAD, 32), [b"", pattern(300_000, 33)]),
        Spec(Kind.CANCEL, {"i": 7}),
    ]
    data = b"".join(s.encode() for s in specs)
    max_chunk = rng.choice([7, 1000, 70_000, 1 << 20])
    frames = feed_buffered(FrameDecoder(), data, rng, max_chunk)
    assert len(frames) == len(specs)
    for spec, frame in zip(specs, frames, strict=True):
        spec.check(frame)


@pytest.mark.parametrize("max_chunk", [4096, 1 << 20])
def test_large_buffers_are_written_straight_into_the_allocated_object(max_chunk: int) -> None:
    big = pattern(STAGING_SIZE * 3 + 11, 40)
    small = pattern(64, 41)
    spec = Spec(Kind.RESPONSE, {"i": 1}, pattern(100, 42), [big, small, ExternalRef(3, 4)])
    allocator = RecordingAllocator()
    decoder = FrameDecoder(allocate=allocator)
    direct_bytes = 0

    def on_write(target: memoryview, n: int) -> None:
        nonlocal direct_bytes
        start = address_of(target)
        for lo, hi in allocator.ranges:
            if lo <= start < hi:
                assert start + n <= hi
                direct_bytes += n

    (frame,) = feed_buffered(decoder, spec.encode(), random.Random(1), max_chunk, on_write)
    spec.check(frame)
    assert allocator.calls == [len(big), len(small)]
    # The frame's buffers are the very objects the allocator made, not copies.
    assert frame.buffers[0] is allocator.objects[0]
    assert frame.buffers[1] is allocator.objects[1]
    # Apart from what was staged before the buffer began, the bytes of the large buffer
    # were written by the "kernel" straight into the allocator's memory.
    assert direct_bytes >= len(big) - STAGING_SIZE


def test_receive_data_buffers_are_the_allocated_objects() -> None:
    spec = Spec(Kind.RESPONSE, {"i": 1}, b"", [pattern(10, 43), b"", pattern(STAGING_SIZE + 1, 44)])
    allocator = RecordingAllocator()
    (frame,) = feed_chunks(spec.encode(), [5000], allocate=allocator)
    spec.check(frame)
    assert allocator.calls == [10, 0, STAGING_SIZE + 1]
    for got, made in zip(frame.buffers, allocator.objects, strict=True):
        assert got is made


# -- adversity -------------------------------------------------------------------------


def _valid_header(**overrides: Any) -> list[Any]:
    header = {"kind": int(Kind.REQUEST), "meta": {"i": 1}, "payload": 0, "descs": []}
    header.update(overrides)
    return [header["kind"], header["meta"], header["payload"], header["descs"]]


BAD_DESC = "malformed buffer descriptor"

BAD_FRAMES: dict[str, tuple[bytes, str]] = {
    "bad magic": (raw_frame(_valid_header(), magic=0x1234), "bad frame prelude"),
    "nonzero flags": (raw_frame(_valid_header(), flags=1), "flags 1"),
    "header too long": (PRELUDE.pack(MAGIC, 0, MAX_HEADER_SIZE + 1), "exceeds"),
    "empty header": (PRELUDE.pack(MAGIC, 0, 0), "undecodable frame header"),
    "garbage msgpack": (PRELUDE.pack(MAGIC, 0, 3) + b"\xc1\xc1\xc1", "undecodable frame header"),
    "truncated msgpack": (PRELUDE.pack(MAGIC, 0, 2) + b"\x94\x0a", "undecodable frame header"),
    "trailing msgpack": (
        PRELUDE.pack(MAGIC, 0, 7) + msgpack.packb([10, {}, 0, []]) + b"\x00\x00",
        "undecodable frame header",
    ),
    "header is a map": (raw_frame({"kind": 10}), "4-item array"),
    "header is an int": (raw_frame(10), "4-item array"),
    "header 3 items": (raw_frame([10, {}, 0]), "4-item array"),
    "header 5 items": (raw_frame([10, {}, 0, [], 1]), "4-item array"),
    "unknown kind": (raw_frame(_valid_header(kind=99)), "unknown message kind 99"),
    "string kind": (raw_frame(_valid_header(kind="REQUEST")), "unknown message kind"),
    "meta not a map": (raw_frame(_valid_header(meta=[1])), "malformed frame header fields"),
    "descriptors not a list": (raw_frame(_valid_header(descs=5)), "malformed frame header fields"),
    "negative payload length": (raw_frame(_valid_header(payload=-1)), "invalid lengths"),
    "string payload length": (raw_frame(_valid_header(payload="5")), "invalid lengths"),
    "float payload length": (raw_frame(_valid_header(payload=1.5)), "invalid lengths"),
    "nil payload length": (raw_frame(_valid_header(payload=None)), "invalid lengths"),
    "negative buffer length": (raw_frame(_valid_header(descs=[3, -1])), "invalid lengths"),
    "negative external length": (raw_frame(_valid_header(descs=[[1, -5]])), "invalid lengths"),
    "descriptor 3-list": (raw_frame(_valid_header(descs=[[1, 2, 3]])), BAD_DESC),
    "descriptor 1-list": (raw_frame(_valid_header(descs=[[1]])), BAD_DESC),
    "descriptor str key": (raw_frame(_valid_header(descs=[["a", 3]])), BAD_DESC),
    "descriptor float": (raw_frame(_valid_header(descs=[[1.5, 3]])), BAD_DESC),
    "descriptor map": (raw_frame(_valid_header(descs=[{"k": 1}])), BAD_DESC),
    "descriptor string": (raw_frame(_valid_header(descs=["x"])), BAD_DESC),
    "descriptor nil": (raw_frame(_valid_header(descs=[None])), BAD_DESC),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_malformed_frames_raise_and_poison(name: str) -> None:
    data, message = BAD_FRAMES[name]
    decoder = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match=message):
        decoder.receive_data(data)
        decoder.next_event()
    # Poisoned: every later call raises, even when fed a perfectly good frame.
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError):
        decoder.receive_data(SMALL_FRAMES[0].encode())
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()


@pytest.mark.parametrize(
    "name", ["bad magic", "header too long", "garbage msgpack", "unknown kind"]
)
def test_malformed_frame_after_a_good_one(name: str) -> None:
    data, message = BAD_FRAMES[name]
    decoder = FrameDecoder()
    decoder.receive_data(SMALL_FRAMES[1].encode())
    SMALL_FRAMES[1].check(decoder.next_event())
    with pytest.raises(RemoteProtocolError, match=message):
        decoder.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=message):
        decoder.next_event()


def test_errors_surface_through_the_buffered_protocol_face() -> None:
    decoder = FrameDecoder()
    data = BAD_FRAMES["unknown kind"][0]
    target = decoder.get_buffer()
    target[: len(data)] = data
    decoder.buffer_updated(len(data))
    with pytest.raises(RemoteProtocolError, match="unknown message kind"):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError, match="unknown message kind"):
        decoder.next_event()


def test_prelude_errors_need_only_the_prelude() -> None:
    """A bad magic or an oversized header length is caught before the header arrives."""
    for data in (PRELUDE.pack(0xBEEF, 0, 10), PRELUDE.pack(MAGIC, 0, 2**32 - 1)):
        decoder = FrameDecoder()
        decoder.receive_data(data[:-1])
        assert decoder.next_event() is NEED_DATA
        with pytest.raises(RemoteProtocolError):
            decoder.receive_data(data[-1:])


@pytest.mark.parametrize(
    ("payload", "descs"),
    [
        (1001, []),
        (0, [1001]),
        (500, [500, 1]),
        (0, [[7, 1001]]),  # external refs count towards the limit as well
        (2**63, []),
        (1, [2**64 - 1]),
    ],
)
def test_oversized_frame_rejected_before_allocation(payload: int, descs: list[Any]) -> None:
    allocator = RecordingAllocator()
    decoder = FrameDecoder(Limits(max_frame_size=1000), allocate=allocator)
    with pytest.raises(RemoteProtocolError, match="exceeds the maximum frame size of 1000"):
        decoder.receive_data(raw_frame([int(Kind.RESPONSE), {"i": 1}, payload, descs]))
    assert allocator.calls == []
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()


def test_frame_of_exactly_max_frame_size_is_accepted() -> None:
    spec = Spec(Kind.RESPONSE, {"i": 1}, pattern(400, 50), [pattern(600, 51)])
    data = spec.encode(max_frame_size=1000)
    (frame,) = feed_chunks(data, [], limits=Limits(max_frame_size=1000))
    spec.check(frame)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param([int(Kind.REQUEST)], id="list"),
        pytest.param({"k": 1}, id="map"),
    ],
)
def test_unhashable_kind_is_a_protocol_error(kind: Any) -> None:
    decoder = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="unknown message kind"):
        decoder.receive_data(raw_frame([kind, {}, 0, []]))
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()


# -- limits before trust ---------------------------------------------------------------

HELLO = Spec(Kind.HELLO, {"v": 1, "name": "w0", "nonce": b"\x00" * 32, "max_frame_size": 1 << 33})


def _handshake_decoder() -> tuple[FrameDecoder, RecordingAllocator]:
    allocator = RecordingAllocator()
    return FrameDecoder(HANDSHAKE_LIMITS, allocate=allocator), allocator


def test_an_unauthenticated_decoder_holds_a_small_staging_area() -> None:
    decoder, _ = _handshake_decoder()
    assert decoder.staging_size == SMALL_STAGING == MAX_HANDSHAKE_FRAME
    assert FrameDecoder().staging_size == STAGING_SIZE
    assert HANDSHAKE_LIMITS.kinds == HANDSHAKE_KINDS


def test_handshake_frames_pass_the_handshake_limits() -> None:
    decoder, _ = _handshake_decoder()
    data = HELLO.encode()
    for i in range(len(data)):
        decoder.receive_data(data[i : i + 1])
    (frame,) = drain(decoder)
    HELLO.check(frame)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        pytest.param(
            [int(Kind.HELLO), {}, int(7.9 * 2**30), []],
            "8482560409 bytes exceeds the maximum frame size of 0 bytes before the handshake",
            id="7.9 GiB HELLO",
        ),
        pytest.param([int(Kind.AUTH), {}, 1, []], "of 0 bytes before", id="one-byte payload"),
        pytest.param([int(Kind.HELLO), {}, 0, [1]], "of 0 bytes before", id="one-byte buffer"),
        pytest.param([int(Kind.HELLO), {}, 0, [[1, 2**40]]], "of 0 bytes", id="external buffer"),
        pytest.param(
            [int(Kind.REQUEST), {"i": 1, "f": "os.system"}, 5, []],
            "REQUEST frame not allowed before the handshake completes",
            id="request",
        ),
        pytest.param(
            [int(Kind.RESPONSE), {}, 2**40, [2**40]], "RESPONSE frame not allowed", id="response"
        ),
    ],
)
def test_the_header_alone_rejects_what_an_unauthenticated_peer_may_not_send(
    header: list[Any], message: str
) -> None:
    """Rejected as soon as the header is parsed: no body byte is sent, none allocated."""
    decoder, allocator = _handshake_decoder()
    with pytest.raises(RemoteProtocolError, match=message):
        decoder.receive_data(raw_frame(header))
    assert allocator.calls == []
    assert decoder.staging_size == SMALL_STAGING
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()


def test_the_prelude_alone_rejects_a_long_header_before_the_handshake() -> None:
    decoder, _ = _handshake_decoder()
    limit = MAX_HANDSHAKE_FRAME - PRELUDE.size
    with pytest.raises(RemoteProtocolError, match=f"{limit + 1} bytes exceeds {limit} before"):
        decoder.receive_data(PRELUDE.pack(MAGIC, 0, limit + 1))


def test_a_whole_frame_of_exactly_max_handshake_frame_bytes_is_accepted() -> None:
    def hello(padding: int) -> bytes:
        return raw_frame([int(Kind.HELLO), {"name": "x" * padding}, 0, []])

    padding = MAX_HANDSHAKE_FRAME - len(hello(0))
    while len(hello(padding)) > MAX_HANDSHAKE_FRAME:  # msgpack's str header grows with it
        padding -= 1
    data = hello(padding)
    assert len(data) == MAX_HANDSHAKE_FRAME
    (frame,) = feed_chunks(data, [100, 4000], limits=HANDSHAKE_LIMITS)
    assert frame.meta == {"name": "x" * padding}
    with pytest.raises(RemoteProtocolError, match="before the handshake"):
        feed_chunks(hello(padding + 1), [], limits=HANDSHAKE_LIMITS)


def test_established_limits_admit_no_more_handshake_frames() -> None:
    limits = Limits.established(1000)
    assert limits.kinds == ESTABLISHED_KINDS == KNOWN_KINDS - HANDSHAKE_KINDS
    with pytest.raises(RemoteProtocolError, match="HELLO frame not allowed after the handshake"):
        feed_chunks(HELLO.encode(), [], limits=limits)


def test_raised_limits_apply_to_the_next_frame_and_grow_the_staging_area() -> None:
    """HELLO and the start of a large request arrive in one read; once the handshake is
    done the request's header is parsed under the new limits, its staged bytes kept."""
    decoder, allocator = _handshake_decoder()
    request = Spec(Kind.REQUEST, {"i": 1, "f": "f"}, pattern(SMALL_PAYLOAD + 9, 60), [b"x" * 70])
    data = HELLO.encode() + request.encode()
    target = decoder.get_buffer()
    n = len(target)
    target[:] = data[:n]
    decoder.buffer_updated(n)
    HELLO.check(decoder.next_event())
    decoder.limits = Limits.established(1 << 20)
    assert decoder.staging_size == STAGING_SIZE
    frames = feed_buffered(decoder, data[n:], random.Random(3), 5000)
    frames += drain(decoder)
    assert len(frames) == 1
    request.check(frames[0])
    assert allocator.calls == [70]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_frame_size": -1},
        {"max_header_size": MAX_HEADER_SIZE + 1},
        {"max_header_size": -1},
        {"kinds": frozenset({99})},
    ],
)
def test_invalid_limits_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"invalid frame limits|unknown kinds"):
        Limits(**kwargs)


# -- encoding limits -------------------------------------------------------------------


def test_encode_oversized_payload_raises_local_protocol_error() -> None:
    with pytest.raises(LocalProtocolError, match="exceeds the maximum frame size of 100"):
        encode_frame(Kind.RESPONSE, {"i": 1}, b"x" * 101, max_frame_size=100)


def test_encode_oversized_buffers_raise_local_protocol_error() -> None:
    bufs = [memoryview(b"x" * 60), memoryview(b"y" * 41)]
    with pytest.raises(LocalProtocolError, match="101 bytes"):
        encode_frame(Kind.RESPONSE, {"i": 1}, b"", bufs, max_frame_size=100)
    # exactly at the limit is fine
    encode_frame(Kind.RESPONSE, {"i": 1}, b"", bufs[:1], max_frame_size=60)


def test_encode_oversized_header_raises_local_protocol_error() -> None:
    with pytest.raises(LocalProtocolError, match="header"):
        encode_frame(Kind.REQUEST, {"i": 1, "f": "x" * MAX_HEADER_SIZE})


def test_encoder_rejects_what_the_decoder_rejects_for_external_refs() -> None:
    """External buffers count toward max_frame_size on both sides: a frame whose refs
    alone exceed it is refused by the encoder, and by a decoder under that limit."""
    refs = [ExternalRef(3, 800), ExternalRef(4, 800)]
    with pytest.raises(LocalProtocolError, match="1600 bytes exceeds the maximum frame size"):
        encode_frame(Kind.RESPONSE, {"i": 1}, b"", refs, max_frame_size=1000)
    data = Spec(Kind.RESPONSE, {"i": 1}, b"", list(refs)).encode(max_frame_size=1600)
    with pytest.raises(RemoteProtocolError, match="1600 bytes exceeds the maximum frame size"):
        feed_chunks(data, [], limits=Limits(max_frame_size=1000))
    (frame,) = feed_chunks(data, [], limits=Limits(max_frame_size=1600))  # at the limit: fine
    assert frame.buffers == refs


# -- property test ---------------------------------------------------------------------

_meta_values = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=40), st.booleans()
)
_buffer_specs = st.one_of(
    st.integers(0, 3000).map(lambda n: ("inline", n)),
    st.sampled_from([SMALL_PAYLOAD + 1, STAGING_SIZE + 1]).map(lambda n: ("inline", n)),
    st.tuples(st.integers(0, 2**31), st.integers(0, 2**30)).map(lambda t: ("ref", t)),
)
_frame_specs = st.tuples(
    st.sampled_from(sorted(KNOWN_KINDS)),
    st.dictionaries(st.text(max_size=8), _meta_values, max_size=4),
    st.one_of(st.integers(0, 2000), st.sampled_from([SMALL_PAYLOAD, SMALL_PAYLOAD + 1, 300_000])),
    st.lists(_buffer_specs, max_size=4),
)


def _build(raw: tuple[int, dict[str, Any], int, list[Any]], seed: int) -> Spec:
    kind, meta, payload_size, buffer_specs = raw
    buffers: list[bytes | ExternalRef] = []
    for i, (what, arg) in enumerate(buffer_specs):
        if what == "ref":
            buffers.append(ExternalRef(*arg))
        else:
            buffers.append(pattern(arg, seed + i + 1))
    return Spec(kind, meta, pattern(payload_size, seed), buffers)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(raw_frames=st.lists(_frame_specs, min_size=1, max_size=5), data=st.data())
def test_property_random_frames_random_chunking(
    raw_frames: list[tuple[int, dict[str, Any], int, list[Any]]], data: st.DataObject
) -> None:
    specs = [_build(raw, 100 * i) for i, raw in enumerate(raw_frames)]
    stream = b"".join(s.encode() for s in specs)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts")
    frames = feed_chunks(stream, cuts)
    assert len(frames) == len(specs)
    for spec, frame in zip(specs, frames, strict=True):
        spec.check(frame)
    # The same stream through the BufferedProtocol face gives the same frames.
    seed = data.draw(st.integers(0, 2**32), label="seed")
    rng = random.Random(seed)
    chunk_sizes = [1, 13, 997] if len(stream) < 20_000 else [997, 65_536, 1 << 20]
    frames = feed_buffered(FrameDecoder(), stream, rng, rng.choice(chunk_sizes))
    assert len(frames) == len(specs)
    for spec, frame in zip(specs, frames, strict=True):
        spec.check(frame)


# -- the fast path for small frames ----------------------------------------------------
# A whole small frame, staged, with inline buffers only, is decoded by one fast step; the
# general path (prelude, header, then body) does the rest.  Both give the same frames, so
# only speed tells them apart: with the general path made to fail, these show which ran.

FAST_FRAMES = [
    Spec(Kind.WELCOME, {}),  # no body at all
    Spec(Kind.RESPONSE, {"i": 1}, pattern(100, 30), [b"", pattern(10, 31), b""]),
    Spec(Kind.REQUEST, {"i": 2, "f": "f"}, pattern(SMALL_PAYLOAD - 10, 32), [pattern(10, 33)]),
]


@pytest.fixture
def fast_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    if is_compiled(codec):  # mypyc calls the method natively: a patch would go unseen
        pytest.skip("patches the codec's methods: the pure-Python job runs it")

    def general_path(self: FrameDecoder, raw: memoryview) -> None:
        raise AssertionError("a small frame took the general path")

    monkeypatch.setattr(FrameDecoder, "_validate_header", general_path)


@pytest.mark.usefixtures("fast_path_only")
@pytest.mark.parametrize("index", range(len(FAST_FRAMES)))
def test_a_whole_small_frame_takes_the_fast_path(index: int) -> None:
    """Including one with an empty body, one with empty buffers, and one whose body is
    exactly SMALL_PAYLOAD bytes; each is exactly what is staged."""
    spec = FAST_FRAMES[index]
    (frame,) = feed_chunks(spec.encode(), [])
    spec.check(frame)


@pytest.mark.usefixtures("fast_path_only")
def test_small_frames_staged_back_to_back_take_the_fast_path() -> None:
    stream = b"".join(spec.encode() for spec in reversed(FAST_FRAMES))
    frames = feed_chunks(stream, [])
    for spec, frame in zip(reversed(FAST_FRAMES), frames, strict=True):
        spec.check(frame)


@pytest.mark.usefixtures("fast_path_only")
def test_a_header_of_exactly_max_header_size_takes_the_fast_path() -> None:
    data = SMALL_FRAMES[1].encode()
    header_size = PRELUDE.unpack_from(data)[2]
    (frame,) = feed_chunks(data, [], limits=Limits(max_header_size=header_size))
    SMALL_FRAMES[1].check(frame)


def test_a_staged_header_one_byte_too_long_is_refused() -> None:
    """The fast path checks the header length too, not only when the header is incomplete."""
    data = SMALL_FRAMES[1].encode()
    limit = PRELUDE.unpack_from(data)[2] - 1
    with pytest.raises(RemoteProtocolError, match=f"exceeds {limit}$"):
        feed_chunks(data, [], limits=Limits(max_header_size=limit))


def test_a_payload_that_looks_like_a_frame_stays_payload() -> None:
    """Once a header is parsed the next bytes are its body, whatever they look like."""
    inner = Spec(Kind.WELCOME, {}).encode()
    outer = Spec(Kind.RESPONSE, {"i": 1}, inner * 3)
    data = outer.encode()
    for cut in range(1, len(data)):
        (frame,) = feed_chunks(data, [cut])
        outer.check(frame)


def test_the_small_staging_area_compacts_behind_a_frame_that_needs_all_of_it() -> None:
    """A small HELLO, then one of MAX_HANDSHAKE_FRAME bytes, in reads of 1000 bytes: the
    second fits only once the staged bytes are moved back to the start."""
    small = raw_frame([int(Kind.HELLO), {}, 0, []])
    padding = MAX_HANDSHAKE_FRAME - len(raw_frame([int(Kind.HELLO), {"p": ""}, 0, []])) - 2
    large = raw_frame([int(Kind.HELLO), {"p": "x" * padding}, 0, []])
    assert len(large) == MAX_HANDSHAKE_FRAME
    decoder = FrameDecoder(HANDSHAKE_LIMITS)
    frames = feed_buffered(decoder, small + large, random.Random(0), 1000)
    assert [f.meta for f in frames] == [{}, {"p": "x" * padding}]


def test_an_empty_decoder_offers_its_whole_staging_area() -> None:
    """Once every staged byte is consumed, the next read may fill all of it."""
    decoder = FrameDecoder()
    decoder.receive_data(SMALL_FRAMES[1].encode())
    SMALL_FRAMES[1].check(decoder.next_event())
    assert len(decoder.get_buffer()) == decoder.staging_size == STAGING_SIZE


# -- limits and encoding details -------------------------------------------------------


def test_zero_limits_are_valid_limits() -> None:
    limits = Limits(max_frame_size=0, max_header_size=0)
    assert (limits.max_frame_size, limits.max_header_size) == (0, 0)


def test_established_limits_take_the_given_max_frame_size() -> None:
    limits = Limits.established(1000)
    assert limits.max_frame_size == 1000
    feed_chunks(Spec(Kind.RESPONSE, {"i": 1}, b"x" * 1000).encode(), [], limits=limits)
    with pytest.raises(RemoteProtocolError, match=r"1001 bytes exceeds .* 1000 bytes after the"):
        feed_chunks(Spec(Kind.RESPONSE, {"i": 1}, b"x" * 1001).encode(), [], limits=limits)


def test_errors_without_a_stage_end_with_the_numbers() -> None:
    with pytest.raises(RemoteProtocolError, match=r"maximum frame size of 10 bytes$"):
        feed_chunks(Spec(Kind.RESPONSE, {}, b"x" * 11).encode(), [], limits=Limits(10))


def test_a_frame_without_payload_has_an_empty_one() -> None:
    (frame,) = feed_chunks(b"".join(bytes(p) for p in encode_frame(Kind.WELCOME, {})), [])
    assert frame.payload == b""


def test_a_payload_up_to_small_payload_is_joined_to_the_header() -> None:
    """One part (one copy, small); above SMALL_PAYLOAD the payload is its own part."""
    assert len(encode_frame(Kind.RESPONSE, {}, pattern(SMALL_PAYLOAD, 34))) == 1
    assert len(encode_frame(Kind.RESPONSE, {}, pattern(SMALL_PAYLOAD + 1, 35))) == 2


def test_a_header_of_exactly_max_header_size_encodes() -> None:
    def header_size(padding: int) -> int:
        return len(msgpack.packb([int(Kind.REQUEST), {"f": "x" * padding}, 0, []]))

    padding = MAX_HEADER_SIZE - header_size(0)
    while header_size(padding) > MAX_HEADER_SIZE:  # msgpack's str header grows with it
        padding -= 1
    assert header_size(padding) == MAX_HEADER_SIZE
    encode_frame(Kind.REQUEST, {"f": "x" * padding})


def test_each_thread_encodes_with_a_packer_of_its_own() -> None:
    """Cached per thread (a new Packer allocates 1 MiB); a fresh thread's first packer
    encodes bytes as bytes, exactly as this thread's does."""
    import threading

    from asyncrpc.wire.codec import _packer

    assert _packer() is _packer()
    spec = Spec(Kind.HELLO, {"nonce": b"\x00\xff" * 16, "name": "w0"})
    made: dict[str, Any] = {}

    def elsewhere() -> None:
        made["packer"], made["data"] = _packer(), spec.encode()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(10)
    assert made["packer"] is not _packer()
    assert made["data"] == spec.encode()
    (frame,) = feed_chunks(made["data"], [])
    spec.check(frame)


def test_need_data_says_what_it_is() -> None:
    assert repr(NEED_DATA) == "NEED_DATA"


# -- BATCH frames: a burst's small messages in one frame --------------------------------


def decoded_one(data: bytes) -> Frame:
    decoder = FrameDecoder(Limits.established(1 << 20))
    decoder.receive_data(data)
    frame = decoder.next_event()
    assert isinstance(frame, Frame) and decoder.next_event() is NEED_DATA
    return frame


def test_a_batch_frame_carries_its_entries_in_order_each_as_its_own_frame() -> None:
    sent = [
        (Kind.REQUEST, {"i": 1, "f": "noop", "p": True}, pattern(37, 1)),
        (Kind.RESPONSE, {"i": 7}, memoryview(pattern(1024, 2))),
        (Kind.NOTICE, {"n": [["k", 1, "two"]]}, b""),
    ]
    frame = decoded_one(codec.encode_batch([codec.encode_entry(*each) for each in sent]))
    assert frame.kind == Kind.BATCH and frame.meta == {} and frame.buffers == []
    got = codec.split_batch(frame.payload, ESTABLISHED_KINDS)
    assert [(f.kind, f.meta, f.payload, f.buffers) for f in got] == [
        (kind, meta, bytes(payload), []) for kind, meta, payload in sent
    ]
    assert all(type(f.payload) is bytes for f in got)


def test_a_batch_is_packed_once_its_entries_are_taken_as_they_are() -> None:
    entries = [codec.encode_entry(Kind.RESPONSE, {"i": i}, b"x") for i in range(3)]
    data = codec.encode_batch(entries)
    assert data.endswith(b"".join(entries))
    assert len(data) < sum(
        len(b"".join(encode_frame(Kind.RESPONSE, {"i": 0}, b"x"))) for _ in entries
    )


def test_an_entry_whose_meta_msgpack_cannot_pack_raises_when_it_is_encoded() -> None:
    with pytest.raises(TypeError):
        codec.encode_entry(Kind.REQUEST, {"c": {"x": object()}}, b"")


def entries_payload(*entries: Any) -> bytes:
    return bytes(msgpack.packb(list(entries), use_bin_type=True))


BAD_BATCHES = {
    "garbage": (b"\xc1\xc1", "undecodable BATCH frame"),
    "truncated": (entries_payload([int(Kind.RESPONSE), {"i": 1}, b"x"])[:-1], "undecodable"),
    "not an array": (entries_payload()[:0] + msgpack.packb({"a": 1}), "not a non-empty array"),
    "empty": (entries_payload(), "not a non-empty array"),
    "an entry of two items": (entries_payload([int(Kind.RESPONSE), {}]), "not a 3-item array"),
    "an entry that is no array": (entries_payload(5), "not a 3-item array"),
    "a batch in a batch": (
        entries_payload([int(Kind.BATCH), {}, entries_payload([int(Kind.NOTICE), {}, b""])]),
        "kind 19 not allowed",
    ),
    "a handshake kind": (entries_payload([int(Kind.HELLO), {}, b""]), "kind 1 not allowed"),
    "an unknown kind": (entries_payload([99, {}, b""]), "kind 99 not allowed"),
    "a kind that is no int": (entries_payload(["REQUEST", {}, b""]), "'REQUEST' not allowed"),
    "a meta that is no map": (entries_payload([int(Kind.NOTICE), [], b""]), "malformed BATCH"),
    "a payload that is text": (entries_payload([int(Kind.NOTICE), {}, "x"]), "malformed BATCH"),
}


@pytest.mark.parametrize("bad", list(BAD_BATCHES))
def test_a_malformed_batch_is_a_protocol_error(bad: str) -> None:
    payload, match = BAD_BATCHES[bad]
    with pytest.raises(RemoteProtocolError, match=match):
        codec.split_batch(payload, ESTABLISHED_KINDS)


def test_a_batch_frame_is_not_allowed_before_the_handshake() -> None:
    data = codec.encode_batch([codec.encode_entry(Kind.NOTICE, {}, b"")])
    decoder = FrameDecoder(HANDSHAKE_LIMITS)
    decoder.receive_data(data[: PRELUDE.size])
    with pytest.raises(RemoteProtocolError, match="BATCH frame not allowed before the handshake"):
        decoder.receive_data(data[PRELUDE.size :])
