"""Connection handshake: protocol version check and mutual HMAC authentication.

Theory of operation
-------------------
Both ends hold the job's secret.  Neither ever sends it; each proves it knows it
by an HMAC over both fresh nonces, both identities and its own role::

    dialer                                      listener
      HELLO {v, identity, nonce_d, max_d, probe_d}  ->
                                  <-   CHALLENGE {v, identity, nonce_l, max_l, probe_l, proof_l}
      AUTH {proof_d, maps_d}                        ->
                                                    <-   WELCOME {maps_l}

A proof binds the role, so a listener's proof cannot be reflected back as a
dialer's.  Until the handshake is ESTABLISHED only handshake frames are legal,
and they carry msgpack metadata only: nothing from an unauthenticated peer is
ever unpickled.  Each end also announces its ``max_frame_size`` (the largest
body it accepts), so that once established a sender can refuse a message the
peer would refuse, and fail only that message (see ``transport.link``).  An end
that lends shared memory announces its probe segment (``offer_memory``); once the
peer is authenticated (never before: opening a file on an unproven peer's word is
a trust it has not earned), each end tries the other's probe with its ``judge``
and says in ``maps`` whether it could (True) or why not, so a segment is lent only
to a peer that proved it can map it (``peer_maps``; ours: ``maps_peer``).  The
machine is events in (``receive(kind, meta)``), messages out (a list of
``(kind, meta)`` to send); it owns no socket.  Every transition lives in
``_TRANSITIONS``; a message that fits none, or a malformed field, raises
``HandshakeError`` and fails the machine for good.  An end may also offer side
connections (``offer_stripes``: a port and a count; see ``transport.stripes``), each
of which later proves itself with ``stripe_proof``: an HMAC over both nonces, both
names and its index.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum, auto
from typing import Any

from asyncrpc.errors import HandshakeError
from asyncrpc.wire.codec import DEFAULT_MAX_FRAME_SIZE
from asyncrpc.wire.messages import PROTOCOL_VERSION, Kind

Outgoing = list[tuple[Kind, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Identity:
    """Who an end of a connection is: worker name and rank, process id, host id."""

    name: str
    rank: int
    pid: int
    host: str


Judge = Callable[[Identity, int | None], str | None]
"""How an end judges a peer's probe segment (see ``Handshake.offer_memory``)."""


class Role(Enum):
    DIALER = auto()
    LISTENER = auto()


class State(Enum):
    START = auto()
    SENT_HELLO = auto()  # dialer, waiting for CHALLENGE
    SENT_AUTH = auto()  # dialer, waiting for WELCOME
    SENT_CHALLENGE = auto()  # listener, waiting for AUTH
    ESTABLISHED = auto()
    FAILED = auto()


def _proof(
    secret: bytes,
    role: Role,
    nonces: tuple[bytes, bytes],
    names: tuple[str, str],
    side: int | None = None,
) -> bytes:
    """HMAC over the role, both nonces (dialer's first) and both names (length-prefixed),
    and for a side connection (``transport.stripes``) its index."""
    fields = [b"asyncrpc", role.name.encode(), *nonces, *(n.encode() for n in names)]
    if side is not None:
        fields += [b"side", str(side).encode()]
    message = b"".join(len(f).to_bytes(4, "big") + f for f in fields)
    return hmac.digest(secret, message, hashlib.sha256)


class Handshake:
    """One end of one connection's handshake."""

    def __init__(
        self,
        role: Role,
        secret: bytes,
        local: Identity,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.role = role
        self.state = State.START
        self.local = local
        self.max_frame_size = max_frame_size  # the largest frame body we accept
        self.peer: Identity | None = None
        self.peer_max_frame_size: int | None = None  # the peer's, once it introduced itself
        self.probe: int | None = None  # our probe segment's key (see offer_memory)
        self.maps_peer: str | None = "not checked"  # why we cannot map its segments (None: can)
        self.peer_maps: str | None = "the peer did not say"  # why it cannot map ours
        self._judge: Judge | None = None
        self.stripes: tuple[int, int] | None = None  # our side connections' port and count
        self.peer_stripes: tuple[int, int] | None = None  # the peer's, if it offered them
        self._peer_probe: int | None = None
        self._secret = secret
        self._nonce = secrets.token_bytes(32)
        self._peer_nonce = b""

    def offer_memory(self, probe: int | None, judge: Judge) -> None:
        """Announce ``probe`` (our probe segment's key; None: we lend nothing) and judge
        the peer's with ``judge(peer, probe)``: None if we can map its segments, else
        why not."""
        self.probe = probe
        self._judge = judge

    def offer_stripes(self, port: int, count: int) -> None:
        """Offer side connections: ``count`` of them, at ``port`` of the address the
        dialer dialed (see ``transport.stripes``)."""
        self.stripes = (port, count)

    @property
    def link_id(self) -> bytes:
        """What names this connection to its side connections: the dialer's nonce."""
        return self._nonces()[0]

    def stripe_proof(self, dialer: bool, index: int) -> bytes:
        """The HMAC that side connection ``index`` of this (established) connection
        carries from its dialer (or, ``dialer=False``, its listener): both nonces, both
        names and the index, under the job's secret."""
        role = Role.DIALER if dialer else Role.LISTENER
        return _proof(self._secret, role, self._nonces(), self._names(), side=index)

    @property
    def established(self) -> bool:
        return self.state is State.ESTABLISHED

    def start(self) -> Outgoing:
        """The dialer's opening message (the listener opens with nothing)."""
        if self.role is Role.LISTENER:
            return []
        self.state = State.SENT_HELLO
        return [(Kind.HELLO, self._introduction())]

    def receive(self, kind: int, meta: dict[str, Any]) -> Outgoing:
        """Feed one handshake frame; returns what to send back.  Raises HandshakeError."""
        step = _TRANSITIONS.get((self.role, self.state, kind))
        if step is None:
            state, self.state = self.state, State.FAILED
            raise HandshakeError(f"unexpected message kind {kind} during handshake ({state.name})")
        try:
            return step(self, meta)
        except HandshakeError:
            self.state = State.FAILED
            raise
        except (KeyError, TypeError, ValueError) as exc:
            self.state = State.FAILED
            raise HandshakeError(f"malformed handshake message: {exc!r}") from exc

    # -- transitions ---------------------------------------------------------------

    def _on_hello(self, meta: dict[str, Any]) -> Outgoing:
        self._accept_peer(meta)
        self.state = State.SENT_CHALLENGE
        reply = self._introduction()
        reply["proof"] = self._make_proof(Role.LISTENER)
        return [(Kind.CHALLENGE, reply)]

    def _on_challenge(self, meta: dict[str, Any]) -> Outgoing:
        self._accept_peer(meta)
        self._check_proof(Role.LISTENER, meta["proof"])
        self.state = State.SENT_AUTH
        return [(Kind.AUTH, self._with_maps({"proof": self._make_proof(Role.DIALER)}))]

    def _on_auth(self, meta: dict[str, Any]) -> Outgoing:
        self._check_proof(Role.DIALER, meta["proof"])
        self.peer_maps = _said(meta.get("maps"))
        self.state = State.ESTABLISHED
        return [(Kind.WELCOME, self._with_maps({}))]

    def _on_welcome(self, meta: dict[str, Any]) -> Outgoing:
        self.peer_maps = _said(meta.get("maps"))
        self.state = State.ESTABLISHED
        return []

    # -- helpers -------------------------------------------------------------------

    def _introduction(self) -> dict[str, Any]:
        introduction = {
            "v": PROTOCOL_VERSION,
            **asdict(self.local),
            "nonce": self._nonce,
            "max_frame_size": self.max_frame_size,
        }
        if self.probe is not None:
            introduction["probe"] = self.probe
        if self.stripes is not None:
            introduction["stripes"] = list(self.stripes)
        return introduction

    def _with_maps(self, message: dict[str, Any]) -> dict[str, Any]:
        """``message``, saying in ``maps`` whether we can map the (now authenticated)
        peer's segments (True) or why not, if we judge them at all (``offer_memory``)."""
        assert self.peer is not None
        if self._judge is not None:
            self.maps_peer = self._judge(self.peer, self._peer_probe)
            message["maps"] = True if self.maps_peer is None else self.maps_peer
        return message

    def _accept_peer(self, meta: dict[str, Any]) -> None:
        if meta["v"] != PROTOCOL_VERSION:
            raise HandshakeError(
                f"peer speaks protocol version {meta['v']!r}, we speak {PROTOCOL_VERSION}"
            )
        nonce = meta["nonce"]
        if not isinstance(nonce, bytes) or len(nonce) != 32:
            raise HandshakeError("handshake nonce must be 32 bytes")
        name, rank, pid, host = meta["name"], meta["rank"], meta["pid"], meta["host"]
        if not (type(name) is str and type(rank) is int and type(pid) is int and type(host) is str):
            raise HandshakeError("malformed peer identity in handshake")
        limit = meta["max_frame_size"]
        if type(limit) is not int or limit < 0:
            raise HandshakeError(f"malformed max_frame_size {limit!r} in handshake")
        probe = meta.get("probe")
        if probe is not None and (type(probe) is not int or probe < 0):
            raise HandshakeError(f"malformed probe {probe!r} in handshake")
        stripes = meta.get("stripes")
        if stripes is not None and not (
            type(stripes) is list
            and len(stripes) == 2
            and all(type(n) is int for n in stripes)
            and 0 < stripes[0] < 65536
            and 0 < stripes[1] <= 64
        ):
            raise HandshakeError(f"malformed stripes {stripes!r} in handshake")
        self.peer_stripes = None if stripes is None else (stripes[0], stripes[1])
        self._peer_probe = probe
        self._peer_nonce = nonce
        self.peer = Identity(name, rank, pid, host)
        self.peer_max_frame_size = limit

    def _names(self) -> tuple[str, str]:
        assert self.peer is not None
        if self.role is Role.DIALER:
            return self.local.name, self.peer.name
        return self.peer.name, self.local.name

    def _nonces(self) -> tuple[bytes, bytes]:
        if self.role is Role.DIALER:
            return self._nonce, self._peer_nonce
        return self._peer_nonce, self._nonce

    def _make_proof(self, role: Role) -> bytes:
        return _proof(self._secret, role, self._nonces(), self._names())

    def _check_proof(self, role: Role, proof: Any) -> None:
        expected = self._make_proof(role)
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, expected):
            peer = self.peer.name if self.peer else "?"
            raise HandshakeError(f"peer {peer!r} failed authentication (wrong job secret)")


def _said(maps: object) -> str | None:
    """What the peer said in ``maps``: None if it can map our segments, else why not."""
    if maps is True:
        return None
    return maps if type(maps) is str else "the peer did not say it can map our segments"


_Step = Callable[[Handshake, dict[str, Any]], Outgoing]
_TRANSITIONS: dict[tuple[Role, State, int], _Step] = {
    (Role.LISTENER, State.START, Kind.HELLO): Handshake._on_hello,
    (Role.DIALER, State.SENT_HELLO, Kind.CHALLENGE): Handshake._on_challenge,
    (Role.LISTENER, State.SENT_CHALLENGE, Kind.AUTH): Handshake._on_auth,
    (Role.DIALER, State.SENT_AUTH, Kind.WELCOME): Handshake._on_welcome,
}
