"""Message kinds and the fields each carries in its header ``meta`` map.

Handshake (meta only: no payload, no buffers, never a pickle; the whole frame at most
``codec.MAX_HANDSHAKE_FRAME`` bytes; ``max_frame_size`` is the most the sender accepts)::

    HELLO      dialer -> listener  {v, name, rank, pid, host, nonce, max_frame_size, probe?,
                                    stripes?: [port, count]}
    CHALLENGE  listener -> dialer  {v, name, rank, pid, host, nonce, max_frame_size, probe?,
                                    stripes?, proof}
    AUTH       dialer -> listener  {proof}
    WELCOME    listener -> dialer  {}

Established::

    REQUEST    {i: call id, f: function name for errors, c?: carried context, n?: notices,
                p?: true when no reducer had a part in the payload (asyncrpc.agent.transfer)}
               payload = pickle((func, args, kwargs))
    RESPONSE   {i, p?}                                     payload = pickle(result)
    ERROR      {i}                                         payload = pickle(exception info)
    CANCEL     {i}          the caller gave up (timeout); the callee may stop the work
    SHUTDOWN   {rank, phase}  the sender reached barrier ``phase`` (1 or 2) of its graceful
               shutdown: its own calls are done (see asyncrpc.agent.shutdown)
    RELEASE    {k: [keys]}  the receiver no longer maps these shared-memory segments
    UNMAP      {k: [keys]}  the sender closed these segments: the receiver drops their mappings
    NOTICE     {n: [[key, *args], ...]}  one-way notices (no reply), as a REQUEST's ``n`` carries
    STRIPES    {ok: true} | {why}  the dialer's word on the link's side connections: all
               up (large buffers may cross them both ways), or not (they use the link's
               stream; see asyncrpc.transport.stripes)
    BATCH      {}           payload = msgpack array of [kind, meta, payload] entries: small
               messages without buffers of one burst, in order, each as if it came in a
               frame of its own (asyncrpc.wire.codec.encode_batch; never nested)
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

PROTOCOL_VERSION: Final = 2
"""2: BATCH frames."""


class Kind(IntEnum):
    """Every message kind; a frame of any other kind is a protocol error."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    REQUEST = 10
    RESPONSE = 11
    ERROR = 12
    CANCEL = 13
    SHUTDOWN = 14
    RELEASE = 15
    NOTICE = 16
    UNMAP = 17
    STRIPES = 18
    BATCH = 19


REQUEST: Final = int(Kind.REQUEST)
"""The per-call kinds as plain ints: comparing with an IntEnum member, or passing one,
costs an attribute lookup on every message."""
RESPONSE: Final = int(Kind.RESPONSE)
ERROR: Final = int(Kind.ERROR)

KNOWN_KINDS: Final = frozenset(int(k) for k in Kind)
HANDSHAKE_KINDS: Final = frozenset({Kind.HELLO, Kind.CHALLENGE, Kind.AUTH, Kind.WELCOME})
ESTABLISHED_KINDS: Final = KNOWN_KINDS - HANDSHAKE_KINDS
