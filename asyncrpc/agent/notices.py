"""One-way notices: small facts for a peer that ride on the next frame sent to it.

Theory of operation
-------------------
Some messages need no reply and no particular moment ("context 42 is released
here, release it there too"); a round trip for each would cost both workers a
request and a reply to encode, send, decode and dispatch.  A *notice* is a key
and a few msgpack-able arguments; an upper layer registers the handler of each
key with :func:`on_notice`, so nothing in a notice is unpickled or names code.

:meth:`Notices.add` queues a notice for a peer.  The agent puts every notice
queued for a peer into the header (``n``) of the next request it makes for that
peer; what is still queued when the loop gets round to it leaves on its own, in
a NOTICE frame (:meth:`Notices.take_all`).  Before its shutdown notices the
agent sends what is queued for that peer.  The receiver runs each handler on
its loop as the frame arrives, before the frame's own message, so notices keep
their order with the frames around them: a peer that has seen our SHUTDOWN, or
answered a later request of ours, has handled every notice we sent before it.
Handlers must be quick and must not block.  A notice with an unknown key or bad
arguments is logged and dropped; the worker keeps serving.

A frame's header holds 64 KiB, and a worker that drops thousands of RRefs at once
queues a notice for each.  So a request carries its peer's notices only while they
take at most ``REQUEST_NOTICE_BYTES`` (a few, as in a training loop); more leave just
ahead of it, in as many NOTICE frames as they need (:func:`in_frames`, at most
``FRAME_NOTICE_BYTES`` each, in order).  A notice that fits no frame, or that msgpack
cannot pack, could never leave: it is logged and dropped, and nothing else with it.

A message that carried notices but never leaves (see
:mod:`asyncrpc.agent.outgoing`) gives them back (:meth:`Notices.give_back`).
They are older than anything else still on its way to that peer, so they go
first: at once in a NOTICE frame if the link is up (before the next message),
else with whatever is next sent to that peer.  A peer that cannot be reached
has nothing left to handle: :meth:`Notices.forget` drops what waits for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Final

import msgpack

from asyncrpc.agent.dispatch import on_loop

log = logging.getLogger("asyncrpc.agent")
Notice = list[Any]  # [key, *args]
Handler = Callable[..., None]  # handler(agent, sender rank, *args)

REQUEST_NOTICE_BYTES: Final = 4 * 1024
"""The most notices (packed) a request carries in its header; more leave ahead of it."""
FRAME_NOTICE_BYTES: Final = 48 * 1024
"""The most notices (packed) one NOTICE frame carries (a header holds 64 KiB)."""
_UNPACKABLE = (TypeError, ValueError, OverflowError)  # what msgpack raises for a value
_local = threading.local()  # a msgpack Packer per thread, to size notices

_handlers: dict[str, Handler] = {}


def on_notice(key: str, handler: Handler) -> None:
    """Run ``handler(agent, sender_rank, *args)`` for every notice ``key`` received."""
    _handlers[key] = handler


class Notices:
    """The notices an agent has queued, per peer name, and the peers it has told."""

    def __init__(self) -> None:
        self._queued: dict[str, list[Notice]] = {}
        self._returned: dict[str, list[Notice]] = {}  # given back: they go first
        self.told: set[str] = set()  # peers sent a notice since the last delivered()

    def add(self, peer: str, notice: Notice) -> bool:
        """Queue ``notice`` for ``peer``; True if it is the only one queued now."""
        first = not self._queued
        self._queued.setdefault(peer, []).append(notice)
        return first

    def take(self, peer: str) -> list[Notice]:
        """Everything waiting for ``peer``, oldest first (then nothing is)."""
        if not self._queued and not self._returned:  # the common case, on every call
            return []
        taken = self._returned.pop(peer, []) + self._queued.pop(peer, [])
        if taken:
            self.told.add(peer)
        return taken

    def take_returned(self, peer: str) -> list[Notice]:
        """What was given back for ``peer``: older than any message still on its way."""
        taken = self._returned.pop(peer, [])
        if taken:
            self.told.add(peer)
        return taken

    def take_all(self) -> dict[str, list[Notice]]:
        """Everything waiting, by peer (then nothing is)."""
        return {peer: self.take(peer) for peer in dict.fromkeys([*self._returned, *self._queued])}

    def give_back(self, peer: str, notices: list[Notice]) -> None:
        """Notices taken for a message that will never leave: they go first again."""
        if notices:
            self._returned[peer] = notices + self._returned.get(peer, [])

    def forget(self, peer: str) -> None:
        """``peer`` cannot be reached: nothing waiting for it will be handled."""
        dropped = len(self._returned.pop(peer, [])) + len(self._queued.pop(peer, []))
        if dropped:
            log.debug("%d notices for %r dropped: it cannot be reached", dropped, peer)

    def __len__(self) -> int:
        return sum(map(len, self._queued.values())) + sum(map(len, self._returned.values()))


def fits_a_request(notices: list[Notice]) -> bool:
    """Whether ``notices`` are few and small enough to ride in a request's header (and
    msgpack can pack each: :func:`in_frames` leaves out one it cannot)."""
    total = 0
    for notice in notices:
        try:
            total += _packed_size(notice)
        except _UNPACKABLE:
            return False
        if total > REQUEST_NOTICE_BYTES:
            return False
    return True


def in_frames(peer: str, notices: list[Notice]) -> list[list[Notice]]:
    """``notices`` for worker ``peer``, in order, split into runs of at most
    ``FRAME_NOTICE_BYTES`` each (one NOTICE frame's worth); a notice that fits no frame,
    or cannot be packed, is logged and left out (it could never leave)."""
    frames: list[list[Notice]] = []
    run: list[Notice] = []
    size = 0
    for notice in notices:
        try:
            nbytes = _packed_size(notice)
        except _UNPACKABLE as exc:
            log.error("notice %.80r for %r dropped: msgpack cannot pack it (%s)", notice, peer, exc)
            continue
        if nbytes > FRAME_NOTICE_BYTES:
            log.error(
                "notice %.80r for %r dropped: %d bytes packed, more than a frame's %d",
                *(notice, peer, nbytes, FRAME_NOTICE_BYTES),
            )
            continue
        if size + nbytes > FRAME_NOTICE_BYTES:
            frames.append(run)
            run, size = [], 0
        run.append(notice)
        size += nbytes
    return [*frames, run] if run else frames


def _packed_size(notice: Notice) -> int:
    packer: msgpack.Packer | None = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return len(packer.pack(notice))


def handle(agent: object, sender: int, notices: Any) -> None:
    """Run the handler of each notice a frame from ``sender`` carried (each handler
    is given ``agent``, the receiving agent, as it is: this module needs nothing of it)."""
    if not isinstance(notices, list):
        log.warning("malformed notices from worker %d: %r", sender, notices)
        return
    for notice in notices:
        handler = _handlers.get(notice[0]) if isinstance(notice, list) and notice else None
        if handler is None:
            log.warning("unknown notice from worker %d: %r", sender, notice)
            continue
        try:
            handler(agent, sender, *notice[1:])
        except Exception:
            log.exception("handling notice %r from worker %d", notice, sender)


@on_loop
def delivered() -> None:
    """Answered by a peer once it has handled every notice sent before this call."""
