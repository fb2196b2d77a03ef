"""Fuzzing the wire layer with hypothesis: what a hostile peer can make of our parsers.

(a) The frame decoder, fed arbitrary bytes, headers of arbitrary msgpack and mutated
    valid frames in arbitrary chunks, either yields frames within its limits or raises
    ``RemoteProtocolError``; it never raises anything else, never asks its allocator
    for more than its limit, and never allocates much more than its limit in all.
(a') A BATCH frame's payload, any msgpack or any bytes, is split into frames of allowed
    kinds or refused with ``RemoteProtocolError``; any batch we encode splits back into
    its messages.
(b) The handshake, fed arbitrary sequences of messages by a peer that does not know the
    secret (but sees every byte we send, and may reflect or forge proofs with it), either
    answers or raises ``HandshakeError``; it never raises anything else and never gets
    past a proof check.

Derandomized, with no example database: the same examples on every run, so CI cannot
flake, and together they take a few seconds.
"""

from __future__ import annotations

import itertools
import tracemalloc
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrpc.errors import HandshakeError, ProtocolError, RemoteProtocolError
from asyncrpc.wire.codec import (
    HANDSHAKE_LIMITS,
    MAGIC,
    NEED_DATA,
    PRELUDE,
    ExternalRef,
    Frame,
    FrameDecoder,
    Limits,
    allocate_bytearray,
    encode_batch,
    encode_entry,
    encode_frame,
    split_batch,
)
from asyncrpc.wire.handshake import Handshake, Identity, Role, State, _proof
from asyncrpc.wire.messages import (
    ESTABLISHED_KINDS,
    HANDSHAKE_KINDS,
    KNOWN_KINDS,
    PROTOCOL_VERSION,
    Kind,
)

FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- (a) the frame decoder -------------------------------------------------------------

LIMITS = [
    HANDSHAKE_LIMITS,
    Limits(max_frame_size=150),
    Limits(max_frame_size=1000),
    Limits.established(64 * 1024),
    Limits(max_frame_size=300_000, max_header_size=100),
]
HUGE = [2**31, 2**32 - 1, int(7.9 * 2**30), 2**40, 2**63, 2**64 - 1]
"""Lengths a hostile peer announces."""
OVER = sorted({1, *(limits.max_frame_size + 1 for limits in LIMITS), *HUGE})
"""The same, and just over each limit above."""
SLACK = 256 * 1024  # bytes the decoder may allocate besides bodies: staged copies, headers


class CountingAllocator:
    """An allocator that fails the test when asked for more than the decoder's limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls = 0

    def __call__(self, nbytes: int) -> tuple[Any, memoryview]:
        assert 0 <= nbytes <= self.limit, f"allocation of {nbytes} bytes above {self.limit}"
        self.calls += 1
        return allocate_bytearray(nbytes)


def _msgpack_values(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=8,
    )


_lengths = st.one_of(
    st.integers(0, 2000),
    st.sampled_from(OVER),
    st.integers(-(2**63), -1),
    st.integers(0, 2**64 - 1),
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    _lengths,
    st.floats(allow_nan=True),
    st.text(max_size=10),
    st.binary(max_size=40),
)
_descriptors = st.lists(
    st.one_of(_lengths, st.tuples(_lengths, _lengths).map(list), _msgpack_values(_leaves)),
    max_size=5,
)
_headers = st.one_of(
    st.tuples(
        st.one_of(st.sampled_from(sorted(KNOWN_KINDS)), _leaves),
        st.one_of(st.dictionaries(st.text(max_size=6), _leaves, max_size=4), _leaves),
        st.one_of(_lengths, _leaves),
        st.one_of(_descriptors, _leaves),
    ).map(list),
    _msgpack_values(_leaves),
)


@st.composite
def _raw_frames(draw: st.DrawFn) -> bytes:
    """A prelude (usually right), a header of arbitrary msgpack, arbitrary body bytes."""
    header = msgpack.packb(draw(_headers), use_bin_type=True)
    magic = draw(st.sampled_from([MAGIC, MAGIC, MAGIC, 0, 0xFFFF]))
    flags = draw(st.sampled_from([0, 0, 0, 1]))
    length = draw(st.sampled_from([len(header)] * 4 + [0, len(header) + 1, 2**32 - 1]))
    body = draw(st.binary(max_size=300))
    return PRELUDE.pack(magic, flags, length) + header + body


@st.composite
def _valid_frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(sorted(KNOWN_KINDS)))
    meta = draw(st.dictionaries(st.text(max_size=6), _leaves, max_size=3))
    payload = draw(st.binary(max_size=200))
    buffers: list[memoryview | ExternalRef] = [
        memoryview(b) if isinstance(b, bytes) else ExternalRef(*b)
        for b in draw(
            st.lists(
                st.one_of(st.binary(max_size=100), st.tuples(_lengths, st.integers(0, 2000))),
                max_size=3,
            )
        )
    ]
    return b"".join(bytes(p) for p in encode_frame(kind, meta, payload, buffers))


def _announcing(data: bytes, nbytes: int, in_buffer: bool) -> bytes:
    """The same frame announcing ``nbytes`` more: as its payload, or as a first buffer."""
    (_, _, header_len) = PRELUDE.unpack_from(data)
    header = msgpack.unpackb(data[PRELUDE.size : PRELUDE.size + header_len])
    if in_buffer:
        header[3] = [nbytes, *header[3]]
    else:
        header[2] = nbytes
    packed = msgpack.packb(header, use_bin_type=True)
    return PRELUDE.pack(MAGIC, 0, len(packed)) + packed + data[PRELUDE.size + header_len :]


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    data = draw(_valid_frames())
    how = draw(st.sampled_from(["flip", "truncate", "payload", "buffer", "header", "splice"]))
    if how == "flip":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] ^= draw(st.integers(1, 255))
        return bytes(buf)
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if how in ("payload", "buffer"):
        return _announcing(data, draw(st.sampled_from(OVER)), how == "buffer")
    if how == "header":
        return PRELUDE.pack(MAGIC, 0, draw(st.sampled_from(HUGE[:2]))) + data[PRELUDE.size :]
    at = draw(st.integers(0, len(data)))
    return data[:at] + draw(st.binary(min_size=1, max_size=30)) + data[at:]


_streams = st.lists(
    st.one_of(_valid_frames(), _raw_frames(), _mutated(), st.binary(max_size=200)),
    min_size=1,
    max_size=4,
).map(b"".join)


def _check_frame(frame: Any, limits: Limits) -> None:
    assert isinstance(frame, Frame)
    assert frame.kind in limits.kinds and type(frame.meta) is dict
    body = len(frame.payload) + sum(
        b.nbytes if isinstance(b, ExternalRef) else len(b) for b in frame.buffers
    )
    assert body <= limits.max_frame_size


def _decode(decoder: FrameDecoder, chunks: list[bytes], buffered: bool, limits: Limits) -> int:
    """Feed ``chunks`` through one face; returns how many frames came out.  Raises what
    the decoder raises."""
    frames = 0
    for chunk in chunks:
        if buffered:
            view = memoryview(chunk)
            while view:
                target = decoder.get_buffer()
                assert len(target) > 0, "get_buffer() returned no room"
                n = min(len(target), len(view))
                target[:n] = view[:n]
                decoder.buffer_updated(n)
                view = view[n:]
                while (event := decoder.next_event()) is not NEED_DATA:
                    _check_frame(event, limits)
                    frames += 1
        else:
            decoder.receive_data(chunk)
            while (event := decoder.next_event()) is not NEED_DATA:
                _check_frame(event, limits)
                frames += 1
    return frames


@FUZZ
@given(
    stream=_streams,
    limits=st.sampled_from(LIMITS),
    cuts=st.lists(st.integers(0, 5000), max_size=8),
    buffered=st.booleans(),
)
def test_decoder_yields_frames_within_its_limits_or_raises_a_protocol_error(
    stream: bytes, limits: Limits, cuts: list[int], buffered: bool
) -> None:
    allocator = CountingAllocator(limits.max_frame_size)
    decoder = FrameDecoder(limits, allocate=allocator)
    bounds = [0, *sorted(c for c in cuts if c < len(stream)), len(stream)]
    chunks = [stream[lo:hi] for lo, hi in itertools.pairwise(bounds)]
    tracemalloc.start()
    try:
        _decode(decoder, chunks, buffered, limits)
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):  # poisoned for good
            decoder.next_event()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= limits.max_frame_size + 2 * len(stream) + SLACK, f"peak {peak} bytes"


_entries = st.one_of(
    st.tuples(
        st.one_of(st.sampled_from(sorted(KNOWN_KINDS)), _leaves),
        st.one_of(st.dictionaries(st.text(max_size=6), _leaves, max_size=3), _leaves),
        st.one_of(st.binary(max_size=60), _leaves),
    ).map(list),
    _msgpack_values(_leaves),
)


@FUZZ
@given(
    payload=st.one_of(
        st.lists(_entries, max_size=6).map(lambda e: msgpack.packb(e, use_bin_type=True)),
        _msgpack_values(_leaves).map(lambda v: msgpack.packb(v, use_bin_type=True)),
        st.binary(max_size=200),
    ),
    kinds=st.sampled_from([ESTABLISHED_KINDS, frozenset({int(Kind.NOTICE)})]),
)
def test_a_batch_payload_splits_into_allowed_frames_or_raises_a_protocol_error(
    payload: bytes, kinds: frozenset[int]
) -> None:
    try:
        frames = split_batch(payload, kinds)
    except RemoteProtocolError:
        return
    assert frames
    for frame in frames:
        assert frame.kind in kinds and frame.kind != Kind.BATCH
        assert type(frame.meta) is dict and type(frame.payload) is bytes and not frame.buffers


_comparable_leaves = st.one_of(  # (NaN is not equal to itself)
    st.none(), st.booleans(), _lengths, st.floats(allow_nan=False), st.text(max_size=10)
)


@FUZZ
@given(
    messages=st.lists(
        st.tuples(
            st.sampled_from(sorted(ESTABLISHED_KINDS - {int(Kind.BATCH)})),
            st.dictionaries(st.text(max_size=6), _comparable_leaves, max_size=3),
            st.binary(max_size=1024),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_any_batch_we_encode_splits_back_into_its_messages(
    messages: list[tuple[int, dict[str, Any], bytes]],
) -> None:
    decoder = FrameDecoder(Limits.established(1 << 20))
    decoder.receive_data(encode_batch([encode_entry(*message) for message in messages]))
    frame = decoder.next_event()
    assert isinstance(frame, Frame) and frame.kind == Kind.BATCH
    split = split_batch(frame.payload, ESTABLISHED_KINDS)
    assert [(f.kind, f.meta, f.payload) for f in split] == messages


@FUZZ
@given(huge=st.sampled_from(HUGE), kind=st.sampled_from(sorted(KNOWN_KINDS)), data=st.data())
def test_huge_announcements_allocate_nothing(huge: int, kind: int, data: st.DataObject) -> None:
    """A header announcing any huge body, in a payload or in buffers: refused from the
    header alone, whatever the limits, and nothing is allocated."""
    limits = data.draw(st.sampled_from(LIMITS), label="limits")
    in_buffer = data.draw(st.booleans(), label="in_buffer")
    header = [kind, {}, 0, [huge]] if in_buffer else [kind, {}, huge, []]
    packed = msgpack.packb(header)
    allocator = CountingAllocator(0)
    decoder = FrameDecoder(limits, allocate=allocator)
    with pytest.raises(RemoteProtocolError):
        decoder.receive_data(PRELUDE.pack(MAGIC, 0, len(packed)) + packed)
    assert allocator.calls == 0


# -- (b) the handshake -----------------------------------------------------------------

SECRET = b"the job's secret, unknown to the fuzzer"
TARGET = Identity("target", 0, 100, "host-t")
INTRODUCTION = {
    "v": PROTOCOL_VERSION,
    "name": "mallory",
    "rank": 7,
    "pid": 666,
    "host": "host-m",
    "max_frame_size": 1 << 20,
}


@dataclass(frozen=True, slots=True)
class Known:
    """Stands, in a drawn message, for the ``index``-th thing the adversary knows (the
    strategies stay fixed, so hypothesis builds them once)."""

    index: int


_values = st.one_of(st.integers(0, 40).map(Known), _leaves)
_fields = [*INTRODUCTION, "nonce", "proof"]
_plausible = st.fixed_dictionaries(
    {**{k: st.just(v) for k, v in INTRODUCTION.items()}, "nonce": st.just(Known(0))},
    optional={"proof": _values},
)
_corrupted = st.tuples(
    _plausible,
    st.dictionaries(st.sampled_from(_fields), _values, max_size=2),
    st.lists(st.sampled_from(_fields), max_size=1),
).map(lambda t: {k: v for k, v in (t[0] | t[1]).items() if k not in t[2]})
_metas = st.sampled_from(
    [
        *[_plausible] * 3,  # its introduction, perhaps with a proof
        *[_corrupted] * 3,  # the same with a field or two changed or left out
        st.dictionaries(st.text(max_size=6), _values, max_size=8),
        _msgpack_values(_leaves),  # anything at all
    ]
).flatmap(lambda strategy: strategy)
_kinds = st.sampled_from([None] * 24 + sorted(KNOWN_KINDS) + [-1, 0, 5, 99, 300])
"""None: the kind the protocol expects next (most often); else any kind, or none known."""
NEXT_KIND = {
    (Role.LISTENER, State.START): Kind.HELLO,
    (Role.LISTENER, State.SENT_CHALLENGE): Kind.AUTH,
    (Role.DIALER, State.SENT_HELLO): Kind.CHALLENGE,
    (Role.DIALER, State.SENT_AUTH): Kind.WELCOME,
}


class Adversary:
    """A peer without the secret: it knows its own nonce, every byte we sent it, and how
    proofs are made, so it can reflect ours and forge its own with ``secrets``."""

    def __init__(self, target: Handshake, secrets: tuple[bytes, ...] = (b"", b"guess")) -> None:
        self.target = target
        self.secrets = secrets
        self.nonce = bytes(range(32))
        self.target_nonce = b""
        self.seen: list[bytes] = []
        self.hear(target.start())

    def hear(self, sent: list[tuple[Kind, dict[str, Any]]]) -> None:
        for kind, meta in sent:
            assert kind in HANDSHAKE_KINDS and type(meta) is dict
            self.seen += [v for v in meta.values() if isinstance(v, bytes)]
            self.target_nonce = meta.get("nonce", self.target_nonce)

    def forgeries(self) -> list[bytes]:
        """Proofs made as the protocol makes them, for either role, nonce order and name
        order: wrong only in the secret."""
        nonces = [(self.nonce, self.target_nonce), (self.target_nonce, self.nonce)]
        names = [("mallory", self.target.local.name), (self.target.local.name, "mallory")]
        return [
            _proof(secret, role, pair, named)
            for secret in self.secrets
            for role in Role
            for pair in nonces
            for named in names
        ]

    def send(self, kind: int | None, meta: Any) -> None:
        """Deliver a drawn message, its Known values resolved, as the wire would."""
        if kind is None:
            kind = NEXT_KIND.get((self.target.role, self.target.state), Kind.WELCOME)
        if type(meta) is dict:
            known = [self.nonce, *self.seen, *self.forgeries()]
            meta = {
                k: known[v.index % len(known)] if isinstance(v, Known) else v
                for k, v in meta.items()
            }
        meta = msgpack.unpackb(msgpack.packb(meta, use_bin_type=True))
        self.hear(self.target.receive(kind, meta))


@FUZZ
@given(role=st.sampled_from(Role), messages=st.lists(st.tuples(_kinds, _metas), max_size=5))
def test_handshake_answers_or_fails_and_never_trusts_without_the_secret(
    role: Role, messages: list[tuple[int | None, Any]]
) -> None:
    target = Handshake(role, SECRET, TARGET, max_frame_size=1 << 30)
    adversary = Adversary(target)
    failed = False
    for kind, meta in messages:
        try:
            adversary.send(kind, meta)
        except (HandshakeError, ProtocolError):
            failed = True
        if failed:  # a failed handshake stays failed, whatever comes next
            assert target.state is State.FAILED and not target.established
        # A listener passes AUTH, and a dialer CHALLENGE, only with a proof made with the
        # secret: neither may get that far.
        assert target.state not in (State.ESTABLISHED, State.SENT_AUTH)


@pytest.mark.parametrize("role", Role)
def test_the_adversary_would_get_in_with_the_secret(role: Role) -> None:
    """Control for the test above: its adversary's messages are right in every way but
    the secret (given the secret, one of its forgeries gets it in)."""
    target = Handshake(role, SECRET, TARGET)
    adversary = Adversary(target, secrets=(SECRET,))
    if role is Role.LISTENER:
        adversary.send(Kind.HELLO, {**INTRODUCTION, "nonce": Known(0)})
        nonces, names = (adversary.nonce, adversary.target_nonce), ("mallory", TARGET.name)
        proof = _proof(SECRET, Role.DIALER, nonces, names)
    else:
        nonces, names = (adversary.target_nonce, adversary.nonce), (TARGET.name, "mallory")
        proof = _proof(SECRET, Role.LISTENER, nonces, names)
    index = 1 + len(adversary.seen) + adversary.forgeries().index(proof)
    adversary.send(None, {**INTRODUCTION, "nonce": Known(0), "proof": Known(index)})
    if role is Role.DIALER:
        adversary.send(None, {})
    assert target.established
    assert target.peer_max_frame_size == INTRODUCTION["max_frame_size"]
