"""Unit tests for the sans-IO connection handshake (version check + mutual HMAC auth)."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrpc.errors import HandshakeError
from asyncrpc.wire.codec import NEED_DATA, Frame, FrameDecoder, encode_frame
from asyncrpc.wire.handshake import Handshake, Identity, Role, State
from asyncrpc.wire.messages import HANDSHAKE_KINDS, PROTOCOL_VERSION, Kind

SECRET = b"job-secret-0123456789"
DIALER_ID = Identity(name="trainer", rank=1, pid=1111, host="host-a")
LISTENER_ID = Identity(name="ps", rank=0, pid=2222, host="host-b")

Outgoing = list[tuple[Kind, dict[str, Any]]]


def pair(
    dialer_secret: bytes = SECRET, listener_secret: bytes = SECRET
) -> tuple[Handshake, Handshake]:
    return (
        Handshake(Role.DIALER, dialer_secret, DIALER_ID),
        Handshake(Role.LISTENER, listener_secret, LISTENER_ID),
    )


def single(messages: Outgoing) -> tuple[Kind, dict[str, Any]]:
    assert len(messages) == 1
    return messages[0]


def over_the_wire(kind: int, meta: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Encode and decode the message, as a real connection would."""
    decoder = FrameDecoder()
    for part in encode_frame(kind, meta):
        decoder.receive_data(part)
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert decoder.next_event() is NEED_DATA
    return frame.kind, frame.meta


def run_to_completion(dialer: Handshake, listener: Handshake) -> list[Kind]:
    """Shuttle messages between the two ends until neither has anything to say."""
    kinds: list[Kind] = []
    to_listener = dialer.start()
    assert listener.start() == []
    to_dialer: Outgoing = []
    while to_listener or to_dialer:
        next_to_dialer: Outgoing = []
        next_to_listener: Outgoing = []
        for kind, meta in to_listener:
            kinds.append(kind)
            next_to_dialer += listener.receive(*over_the_wire(kind, meta))
        for kind, meta in to_dialer:
            kinds.append(kind)
            next_to_listener += dialer.receive(*over_the_wire(kind, meta))
        to_listener, to_dialer = next_to_listener, next_to_dialer
    return kinds


# -- success ---------------------------------------------------------------------------


def test_dialer_and_listener_complete() -> None:
    dialer, listener = pair()
    assert not dialer.established and not listener.established
    kinds = run_to_completion(dialer, listener)
    assert kinds == [Kind.HELLO, Kind.CHALLENGE, Kind.AUTH, Kind.WELCOME]
    assert dialer.established and listener.established
    assert dialer.state is State.ESTABLISHED and listener.state is State.ESTABLISHED
    assert dialer.peer == LISTENER_ID
    assert listener.peer == DIALER_ID


def test_each_end_learns_the_others_max_frame_size() -> None:
    dialer = Handshake(Role.DIALER, SECRET, DIALER_ID, max_frame_size=1000)
    listener = Handshake(Role.LISTENER, SECRET, LISTENER_ID, max_frame_size=2**40)
    assert dialer.peer_max_frame_size is None and listener.peer_max_frame_size is None
    run_to_completion(dialer, listener)
    assert dialer.peer_max_frame_size == 2**40
    assert listener.peer_max_frame_size == 1000


def test_state_after_each_step() -> None:
    dialer, listener = pair()
    assert dialer.state is State.START and listener.state is State.START
    hello = single(dialer.start())
    assert hello[0] is Kind.HELLO and dialer.state is State.SENT_HELLO
    challenge = single(listener.receive(*hello))
    assert challenge[0] is Kind.CHALLENGE and listener.state is State.SENT_CHALLENGE
    auth = single(dialer.receive(*challenge))
    assert auth[0] is Kind.AUTH and dialer.state is State.SENT_AUTH
    welcome = single(listener.receive(*auth))
    assert welcome == (Kind.WELCOME, {}) and listener.established
    assert dialer.receive(*welcome) == [] and dialer.established


def test_messages_carry_no_secret_and_only_plain_data() -> None:
    dialer, listener = pair()
    hello = single(dialer.start())
    challenge = single(listener.receive(*hello))
    auth = single(dialer.receive(*challenge))
    for kind, meta in (hello, challenge, auth):
        assert kind in HANDSHAKE_KINDS
        for value in meta.values():
            assert isinstance(value, int | str | bytes)
            if isinstance(value, bytes):
                assert SECRET not in value
    assert hello[1]["v"] == PROTOCOL_VERSION
    assert len(hello[1]["nonce"]) == 32
    assert len(challenge[1]["nonce"]) == 32
    assert hello[1]["nonce"] != challenge[1]["nonce"]


def test_fresh_nonces_give_fresh_proofs() -> None:
    proofs = set()
    for _ in range(3):
        dialer, listener = pair()
        challenge = single(listener.receive(*single(dialer.start())))
        auth = single(dialer.receive(*challenge))
        proofs.add(challenge[1]["proof"])
        proofs.add(auth[1]["proof"])
    assert len(proofs) == 6


# -- authentication failures ---------------------------------------------------------


def test_wrong_secret_fails_on_the_dialer() -> None:
    """The dialer checks the listener's proof first, so it is the dialer that refuses."""
    dialer, listener = pair(dialer_secret=b"other secret")
    challenge = single(listener.receive(*single(dialer.start())))
    with pytest.raises(HandshakeError, match="authentication") as info:
        dialer.receive(*challenge)
    assert "'ps'" in str(info.value)  # names the peer that failed
    assert isinstance(info.value, ConnectionError)
    assert dialer.state is State.FAILED
    assert not dialer.established


def test_dialer_without_secret_fails_on_the_listener() -> None:
    """A dialer with the wrong secret that ignores its own check still cannot pass AUTH."""
    dialer, listener = pair(dialer_secret=b"guess")
    challenge = single(listener.receive(*single(dialer.start())))
    with pytest.raises(HandshakeError):
        dialer.receive(*challenge)  # the honest check fails; an attacker would go on:
    forged = dialer._make_proof(Role.DIALER)  # right nonces and names, wrong secret
    with pytest.raises(HandshakeError, match="authentication") as info:
        listener.receive(Kind.AUTH, {"proof": forged})
    assert "'trainer'" in str(info.value)
    assert listener.state is State.FAILED
    assert not listener.established


@pytest.mark.parametrize("proof", [b"", b"\x00" * 32, "not bytes", None, 12345, [1, 2]])
def test_bad_auth_proofs_fail_on_the_listener(proof: Any) -> None:
    dialer, listener = pair()
    listener.receive(*single(dialer.start()))
    with pytest.raises(HandshakeError, match="authentication"):
        listener.receive(Kind.AUTH, {"proof": proof})
    assert listener.state is State.FAILED


def test_listener_proof_reflected_as_dialer_proof_fails() -> None:
    """Reflection: an attacker sends HELLO, then echoes the listener's proof as its AUTH."""
    attacker, listener = pair(dialer_secret=b"unknown")
    challenge = single(listener.receive(*single(attacker.start())))
    with pytest.raises(HandshakeError, match="authentication"):
        listener.receive(Kind.AUTH, {"proof": challenge[1]["proof"]})
    assert listener.state is State.FAILED


def test_dialer_proof_reflected_as_listener_proof_fails() -> None:
    """A proof made for the dialer role never passes as a listener's (same nonces, names)."""
    dialer, listener = pair()
    hello = single(dialer.start())
    challenge = single(listener.receive(*hello))
    auth = single(dialer.receive(*challenge))
    victim = Handshake(Role.DIALER, SECRET, DIALER_ID)
    victim._nonce = hello[1]["nonce"]  # the same connection parameters as `dialer`
    victim.start()
    with pytest.raises(HandshakeError, match="authentication"):
        victim.receive(Kind.CHALLENGE, dict(challenge[1], proof=auth[1]["proof"]))
    assert victim.state is State.FAILED
    # ...whereas the genuine listener proof passes for it: only the role differs.
    control = Handshake(Role.DIALER, SECRET, DIALER_ID)
    control._nonce = hello[1]["nonce"]
    control.start()
    assert single(control.receive(*challenge))[0] is Kind.AUTH


def test_proof_is_bound_to_the_names() -> None:
    """A CHALLENGE relayed under another listener name does not authenticate."""
    dialer, listener = pair()
    challenge = single(listener.receive(*single(dialer.start())))
    renamed = dict(challenge[1], name="impostor")
    with pytest.raises(HandshakeError, match="authentication"):
        dialer.receive(Kind.CHALLENGE, renamed)


def test_proof_is_bound_to_the_nonces() -> None:
    """A CHALLENGE replayed from an earlier connection fails on a new one (fresh nonce)."""
    old_dialer, old_listener = pair()
    old_challenge = single(old_listener.receive(*single(old_dialer.start())))
    dialer, _ = pair()
    dialer.start()
    with pytest.raises(HandshakeError, match="authentication"):
        dialer.receive(*old_challenge)
    assert dialer.state is State.FAILED


# -- version ---------------------------------------------------------------------------


def test_version_mismatch_fails_on_the_listener() -> None:
    dialer, listener = pair()
    kind, meta = single(dialer.start())
    with pytest.raises(HandshakeError, match="version") as info:
        listener.receive(kind, dict(meta, v=PROTOCOL_VERSION + 1))
    assert str(PROTOCOL_VERSION + 1) in str(info.value)
    assert listener.state is State.FAILED


def test_version_mismatch_fails_on_the_dialer() -> None:
    dialer, listener = pair()
    challenge = single(listener.receive(*single(dialer.start())))
    with pytest.raises(HandshakeError, match="version"):
        dialer.receive(Kind.CHALLENGE, dict(challenge[1], v=0))
    assert dialer.state is State.FAILED


# -- message order ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Kind.AUTH, Kind.WELCOME, Kind.CHALLENGE, Kind.REQUEST])
def test_listener_rejects_anything_but_hello_first(kind: Kind) -> None:
    _, listener = pair()
    with pytest.raises(HandshakeError, match="unexpected message kind"):
        listener.receive(kind, {"proof": b"\x00" * 32})
    assert listener.state is State.FAILED


@pytest.mark.parametrize("kind", [Kind.HELLO, Kind.WELCOME, Kind.AUTH, Kind.RESPONSE])
def test_dialer_rejects_anything_but_challenge_after_hello(kind: Kind) -> None:
    dialer, _ = pair()
    dialer.start()
    with pytest.raises(HandshakeError, match="unexpected message kind"):
        dialer.receive(kind, {})
    assert dialer.state is State.FAILED


def test_dialer_rejects_messages_before_start() -> None:
    dialer, listener = pair()
    other, _ = pair()
    challenge = single(listener.receive(*single(other.start())))
    with pytest.raises(HandshakeError, match="unexpected"):
        dialer.receive(*challenge)
    assert dialer.state is State.FAILED


def test_listener_rejects_a_second_hello() -> None:
    dialer, listener = pair()
    hello = single(dialer.start())
    listener.receive(*hello)
    with pytest.raises(HandshakeError, match="unexpected"):
        listener.receive(*hello)
    assert listener.state is State.FAILED


def test_dialer_rejects_a_second_challenge() -> None:
    dialer, listener = pair()
    challenge = single(listener.receive(*single(dialer.start())))
    dialer.receive(*challenge)
    with pytest.raises(HandshakeError, match="unexpected"):
        dialer.receive(*challenge)
    assert dialer.state is State.FAILED


def test_established_ends_accept_no_more_handshake_messages() -> None:
    dialer, listener = pair()
    run_to_completion(dialer, listener)
    with pytest.raises(HandshakeError):
        listener.receive(Kind.AUTH, {"proof": b""})
    with pytest.raises(HandshakeError):
        dialer.receive(Kind.WELCOME, {})


def test_failed_handshake_stays_failed() -> None:
    dialer, listener = pair()
    hello = single(dialer.start())
    with pytest.raises(HandshakeError):
        listener.receive(Kind.AUTH, {"proof": b""})
    assert listener.state is State.FAILED
    # Even a perfectly good HELLO is refused now.
    with pytest.raises(HandshakeError):
        listener.receive(*hello)
    assert listener.state is State.FAILED
    assert not listener.established


# -- malformed messages ----------------------------------------------------------------


def _hello() -> dict[str, Any]:
    dialer, _ = pair()
    return single(dialer.start())[1]


HELLO_CORRUPTIONS: dict[str, Any] = {
    "missing v": lambda m: {k: v for k, v in m.items() if k != "v"},
    "missing nonce": lambda m: {k: v for k, v in m.items() if k != "nonce"},
    "missing name": lambda m: {k: v for k, v in m.items() if k != "name"},
    "missing rank": lambda m: {k: v for k, v in m.items() if k != "rank"},
    "missing pid": lambda m: {k: v for k, v in m.items() if k != "pid"},
    "missing host": lambda m: {k: v for k, v in m.items() if k != "host"},
    "empty": lambda m: {},
    "short nonce": lambda m: dict(m, nonce=b"\x01" * 31),
    "long nonce": lambda m: dict(m, nonce=b"\x01" * 33),
    "empty nonce": lambda m: dict(m, nonce=b""),
    "str nonce": lambda m: dict(m, nonce="x" * 32),
    "int nonce": lambda m: dict(m, nonce=7),
    "rank not a number": lambda m: dict(m, rank="zero"),
    "rank nil": lambda m: dict(m, rank=None),
    "pid list": lambda m: dict(m, pid=[1]),
    "rank nan": lambda m: dict(m, rank=float("nan")),
    "missing max_frame_size": lambda m: {k: v for k, v in m.items() if k != "max_frame_size"},
    "negative max_frame_size": lambda m: dict(m, max_frame_size=-1),
    "str max_frame_size": lambda m: dict(m, max_frame_size="8G"),
    "float max_frame_size": lambda m: dict(m, max_frame_size=1e9),
    "bool max_frame_size": lambda m: dict(m, max_frame_size=True),
    "nil max_frame_size": lambda m: dict(m, max_frame_size=None),
}


@pytest.mark.parametrize("name", sorted(HELLO_CORRUPTIONS))
def test_malformed_hello_raises_handshake_error(name: str) -> None:
    _, listener = pair()
    meta = HELLO_CORRUPTIONS[name](_hello())
    with pytest.raises(HandshakeError) as info:
        listener.receive(Kind.HELLO, meta)
    assert not isinstance(info.value, KeyError | TypeError)
    assert listener.state is State.FAILED


@pytest.mark.parametrize("meta", [None, [], "hello", 5], ids=["nil", "list", "str", "int"])
def test_hello_that_is_not_a_map_raises_handshake_error(meta: Any) -> None:
    _, listener = pair()
    with pytest.raises(HandshakeError, match="malformed"):
        listener.receive(Kind.HELLO, meta)
    assert listener.state is State.FAILED


@pytest.mark.parametrize("drop", ["proof", "nonce", "v", "name", "max_frame_size"])
def test_malformed_challenge_raises_handshake_error(drop: str) -> None:
    dialer, listener = pair()
    challenge = single(listener.receive(*single(dialer.start())))
    meta = {k: v for k, v in challenge[1].items() if k != drop}
    with pytest.raises(HandshakeError):
        dialer.receive(Kind.CHALLENGE, meta)
    assert dialer.state is State.FAILED


def test_auth_without_proof_raises_handshake_error() -> None:
    dialer, listener = pair()
    listener.receive(*single(dialer.start()))
    with pytest.raises(HandshakeError, match="malformed"):
        listener.receive(Kind.AUTH, {})
    assert listener.state is State.FAILED


@pytest.mark.parametrize("field", ["rank", "pid"])
def test_infinite_rank_raises_handshake_error(field: str) -> None:
    _, listener = pair()
    meta = dict(_hello(), **{field: float("inf")})
    with pytest.raises(HandshakeError):
        listener.receive(Kind.HELLO, meta)
    assert listener.state is State.FAILED


# -- what the proof is made of ---------------------------------------------------------


def test_the_proof_is_an_hmac_of_length_prefixed_fields() -> None:
    """The proof's layout is part of the protocol (both ends must compute the same
    bytes): HMAC-SHA256 over b"asyncrpc", the role, the dialer's then the listener's
    nonce and names, each prefixed with its length as 4 big-endian bytes."""
    import hashlib
    import hmac

    dialer, listener = pair()
    hello = single(dialer.start())
    challenge = single(listener.receive(*hello))
    fields = [
        b"asyncrpc",
        b"LISTENER",
        hello[1]["nonce"],
        challenge[1]["nonce"],
        DIALER_ID.name.encode(),
        LISTENER_ID.name.encode(),
    ]
    message = b"".join(len(f).to_bytes(4, "big") + f for f in fields)
    assert challenge[1]["proof"] == hmac.digest(SECRET, message, hashlib.sha256)


def test_a_new_handshake_knows_no_peer() -> None:
    dialer, listener = pair()
    assert dialer.peer is None and listener.peer is None
    assert dialer.peer_max_frame_size is None


def test_a_peer_may_accept_no_body_at_all() -> None:
    """max_frame_size 0 is a limit, not a malformed field."""
    _, listener = pair()
    listener.receive(Kind.HELLO, dict(_hello(), max_frame_size=0))
    assert listener.peer_max_frame_size == 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("short nonce", "handshake nonce must be 32 bytes"),
        ("rank not a number", "malformed peer identity in handshake"),
        ("negative max_frame_size", "malformed max_frame_size -1 in handshake"),
    ],
)
def test_a_malformed_hello_says_what_is_wrong(name: str, message: str) -> None:
    _, listener = pair()
    with pytest.raises(HandshakeError, match=message):
        listener.receive(Kind.HELLO, HELLO_CORRUPTIONS[name](_hello()))


# -- shared memory: probes judged once the peer is authenticated ------------------------


class Judge:
    """A fake judge of the peer's probe: records what it saw, answers ``verdict``."""

    def __init__(self, verdict: str | None) -> None:
        self.verdict = verdict
        self.seen: list[tuple[str, int | None]] = []

    def __call__(self, peer: Identity, probe: int | None) -> str | None:
        self.seen.append((peer.name, probe))
        return self.verdict


def test_each_end_learns_whether_the_other_maps_its_segments() -> None:
    dialer, listener = pair()
    dialer_judge, listener_judge = Judge(None), Judge("different PID namespace")
    dialer.offer_memory(7 << 32 | 5, dialer_judge)
    listener.offer_memory(9 << 32 | 6, listener_judge)
    run_to_completion(dialer, listener)
    assert dialer_judge.seen == [("ps", 9 << 32 | 6)]  # each judged the other's probe once
    assert listener_judge.seen == [("trainer", 7 << 32 | 5)]
    assert (dialer.maps_peer, listener.peer_maps) == (None, None)  # the dialer maps its peer's
    assert listener.maps_peer == dialer.peer_maps == "different PID namespace"


def test_probes_are_judged_only_once_the_peer_is_authenticated() -> None:
    """Opening a file on an unauthenticated peer's word would trust it too early."""
    dialer, listener = pair(listener_secret=b"another secret")
    dialer_judge, listener_judge = Judge(None), Judge(None)
    dialer.offer_memory(1, dialer_judge)
    listener.offer_memory(2, listener_judge)
    challenge = single(listener.receive(*single(dialer.start())))
    assert listener_judge.seen == []  # HELLO came from a peer not yet proven
    with pytest.raises(HandshakeError, match="failed authentication"):
        dialer.receive(*challenge)
    assert dialer_judge.seen == []


def test_an_end_that_judges_nothing_says_nothing_and_is_lent_nothing() -> None:
    dialer, listener = pair()
    judge = Judge(None)
    dialer.offer_memory(7, judge)
    hello = single(dialer.start())
    challenge = single(listener.receive(*hello))
    assert "probe" in hello[1] and "probe" not in challenge[1]  # the listener lends nothing
    welcome = single(listener.receive(*single(dialer.receive(*challenge))))
    assert welcome == (Kind.WELCOME, {})  # the wire of an end that offers no memory
    dialer.receive(*welcome)
    assert judge.seen == [("ps", None)]
    assert dialer.peer_maps == "the peer did not say it can map our segments"


@pytest.mark.parametrize("probe", [-1, "7", 1.5, b"\x07"])
def test_a_malformed_probe_fails_the_handshake(probe: object) -> None:
    _, listener = pair()
    with pytest.raises(HandshakeError, match="malformed probe"):
        listener.receive(Kind.HELLO, dict(_hello(), probe=probe))


# -- side connections: each end offers its stripe listener's port and count -------------


def test_each_end_learns_the_others_stripes() -> None:
    dialer, listener = pair()
    dialer.offer_stripes(40001, 2)
    listener.offer_stripes(40002, 4)
    assert dialer.peer_stripes is None and listener.peer_stripes is None
    run_to_completion(dialer, listener)
    assert dialer.peer_stripes == (40002, 4)
    assert listener.peer_stripes == (40001, 2)


def test_an_end_that_offers_no_stripes_says_nothing_of_them() -> None:
    dialer, listener = pair()
    dialer.offer_stripes(40001, 2)
    hello = single(dialer.start())
    challenge = single(listener.receive(*over_the_wire(*hello)))
    assert hello[1]["stripes"] == [40001, 2] and "stripes" not in challenge[1]
    dialer.receive(*over_the_wire(*challenge))
    assert dialer.peer_stripes is None  # the listener offers none
    assert listener.peer_stripes == (40001, 2)


@pytest.mark.parametrize("stripes", [[1, 1], [65535, 64]], ids=["least", "most"])
def test_stripes_at_the_bounds_are_accepted(stripes: list[int]) -> None:
    _, listener = pair()
    listener.receive(Kind.HELLO, dict(_hello(), stripes=stripes))
    assert listener.peer_stripes == tuple(stripes)


MALFORMED_STRIPES: dict[str, Any] = {
    "a string": "40001,2",
    "an int": 40001,
    "a map": {"port": 40001, "count": 2},
    "empty": [],
    "one field": [40001],
    "three fields": [40001, 2, 1],
    "port 0": [0, 2],
    "port 65536": [65536, 2],
    "port 70000": [70000, 2],
    "negative port": [-1, 2],
    "count 0": [40001, 0],
    "count 65": [40001, 65],
    "negative count": [40001, -2],
    "float port": [40001.0, 2],
    "str port": ["40001", 2],
    "bool count": [40001, True],
    "nil count": [40001, None],
}


@pytest.mark.parametrize("name", sorted(MALFORMED_STRIPES))
def test_malformed_stripes_fail_the_listener(name: str) -> None:
    _, listener = pair()
    meta = dict(_hello(), stripes=MALFORMED_STRIPES[name])
    with pytest.raises(HandshakeError, match="malformed stripes"):
        listener.receive(*over_the_wire(Kind.HELLO, meta))
    assert listener.state is State.FAILED
    assert listener.peer_stripes is None


@pytest.mark.parametrize("name", ["port 70000", "count 0", "a string"])
def test_malformed_stripes_fail_the_dialer(name: str) -> None:
    dialer, listener = pair()
    challenge = single(listener.receive(*single(dialer.start())))
    with pytest.raises(HandshakeError, match="malformed stripes"):
        dialer.receive(Kind.CHALLENGE, dict(challenge[1], stripes=MALFORMED_STRIPES[name]))
    assert dialer.state is State.FAILED
