"""A silent peer is a lost peer: TCP keepalive and TCP_USER_TIMEOUT on every tcp link.

Theory of operation
-------------------
A slow peer and a silent one look alike to a caller waiting for a reply, but not to
the kernel: a peer whose process is busy still has a kernel that acknowledges our
bytes and answers keepalive probes; a peer cut off by a partition, or whose host
died, answers nothing.  So the kernel decides, and no protocol of ours is needed.
Given the bound ``B`` (``silent_peer_timeout``, seconds), each tcp link sets:

* ``TCP_USER_TIMEOUT`` = ``B``: bytes we sent (a request, a reply) that stay
  unacknowledged for ``B`` make the kernel drop the connection (``ETIMEDOUT``);
* ``SO_KEEPALIVE``, with ``TCP_KEEPIDLE`` = ``B/2`` and ``TCP_KEEPINTVL`` = ``B/10``
  (whole seconds, at least 1) and ``TCP_KEEPCNT`` enough probes to span ``B``: a
  link with nothing unacknowledged (its calls are in flight, waiting for replies) is
  probed after ``B/2`` of silence, and dropped once ``B`` has passed since the peer
  last sent anything (with ``TCP_USER_TIMEOUT`` set, Linux counts time, not probes).

Either way the connection fails about ``B`` after the peer's last sign of life (plus
at most a probe interval), the Link reports it lost, and the agent fails every call
waiting on that peer with ``PeerLostError``.  Keepalive counts whole seconds, so a
``B`` under 2 s takes about 2 s.  ``B = 0`` sets nothing: the kernel's defaults
(no keepalive; about 15 minutes of retransmissions) then decide.  Unix sockets need
none of this: both ends share a kernel, which reports a dead peer at once.

The price: Linux applies ``TCP_USER_TIMEOUT`` to a receive window that stays closed
too, so a peer that reads nothing for ``B`` while we have bytes for it (its event loop
blocked, its process stopped) is dropped though its kernel answers (docs/deploy.md).
"""

from __future__ import annotations

import math
import socket
from typing import Final, Protocol

DEFAULT_SILENT_PEER_TIMEOUT: Final = 30.0  # well under rpc_timeout; a loop blocked this long
# while a peer sends to it is dropped too (see docs/deploy.md)
"""Seconds of silence after which a tcp peer is lost (``silent_peer_timeout``)."""


class SocketLike(Protocol):
    """What we use of a socket (uvloop hands out a look-alike, not a ``socket.socket``)."""

    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def silence_options(bound: float) -> list[tuple[int, int, int]]:
    """The ``(level, option, value)`` settings that drop a tcp connection whose peer
    stays silent for ``bound`` seconds (see the module docstring); none for 0."""
    if bound <= 0:
        return []
    idle = max(1, int(bound / 2))
    interval = max(1, int(bound / 10))
    count = max(1, math.ceil((bound - idle) / interval))
    tcp = socket.IPPROTO_TCP
    return [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (tcp, socket.TCP_KEEPIDLE, idle),
        (tcp, socket.TCP_KEEPINTVL, interval),
        (tcp, socket.TCP_KEEPCNT, count),
        (tcp, socket.TCP_USER_TIMEOUT, max(1, round(bound * 1000))),
    ]


def detect_silence(sock: SocketLike, bound: float) -> None:
    """Have the kernel drop ``sock`` (a tcp socket) once its peer is silent for ``bound``
    seconds."""
    for level, option, value in silence_options(bound):
        sock.setsockopt(level, option, value)
