"""Admission of inbound connections: a bound on those not authenticated yet.

Theory of operation
-------------------
An inbound connection costs a Link (a decoder with its small staging area, a
handshake, a timer) from the moment it is accepted until it authenticates, and
anyone who can reach the port can open one.  ``handshake_timeout`` bounds how
long each may stay; :class:`Admission` bounds how many there are at once.  The
listener's protocol factory asks :meth:`Admission.admit` for a protocol: up to
``limit`` Links may be handshaking at once; beyond that, a new connection gets
:class:`Refused`, which closes it as soon as it is made, and a warning says so
at most once every ``WARN_EVERY`` seconds of an injected clock (with how many
were refused since).
A Link leaves the count when it is established or lost (``settled``), so an
established peer never holds a slot.  Outgoing links are not counted: we dialed
them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import cast

from asyncrpc.transport.link import Link

log = logging.getLogger("asyncrpc.transport")
WARN_EVERY = 10.0  # seconds between two warnings about refused connections


class Refused(asyncio.Protocol):
    """A connection over the limit: closed as soon as it is made, nothing read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()  # uvloop's are not subclasses


class Admission:
    """Counts the inbound Links still handshaking; refuses connections past ``limit``."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self.refused = 0  # connections refused in all
        self._handshaking: set[Link] = set()
        self._unreported = 0  # refused since the last warning
        self._warned_at = -WARN_EVERY

    @property
    def pending(self) -> int:
        """Inbound connections accepted and not authenticated (nor lost) yet."""
        return len(self._handshaking)

    def admit(self, make: Callable[[], Link]) -> asyncio.BaseProtocol:
        """A new Link from ``make()``, or :class:`Refused` when ``limit`` are pending."""
        if len(self._handshaking) >= self.limit:
            self._refuse()
            return Refused()
        link = make()
        self._handshaking.add(link)
        return link

    def settled(self, link: Link) -> None:
        """``link`` was established or lost: it no longer counts (any link may be given)."""
        self._handshaking.discard(link)

    def _refuse(self) -> None:
        self.refused += 1
        self._unreported += 1
        now = self.clock()
        if now - self._warned_at >= WARN_EVERY:
            log.warning(
                "refusing inbound connections: %d are still authenticating "
                "(max_pending_handshakes); %d refused since the last warning",
                len(self._handshaking),
                self._unreported,
            )
            self._warned_at, self._unreported = now, 0
