"""One-way notices: small facts for a peer that ride on the next frame sent to it.

Theory of operation
-------------------
Some messages need no reply and no particular moment ("context 42 is released
here, release it there too"); a round trip for each would cost both workers a
request and a reply to encode, send, decode and dispatch.  A *notice* is a key
and a few msgpack-able arguments; an upper layer registers the handler of each
key with :func:`on_notice`, so nothing in a notice is unpickled or names code.

:meth:`Notices.add` queues a notice for a peer.  The agent puts every notice
queued for a peer into the header (``n``) of the next request it sends that
peer; what is still queued when the loop gets round to it leaves on its own, in
a NOTICE frame (:meth:`Notices.take_all`).  Before its shutdown notices the
agent sends what is queued for that peer.  The receiver runs each handler on
its loop as the frame arrives, before the frame's own message, so notices keep
their order with the frames around them: a peer that has seen our SHUTDOWN, or
answered a later request of ours, has handled every notice we sent before it.
Handlers must be quick and must not block.  A notice with an unknown key or bad
arguments is logged and dropped; the worker keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrpc.agent.dispatch import on_loop

if TYPE_CHECKING:
    from asyncrpc.agent.agent import RpcAgent

log = logging.getLogger("asyncrpc.agent")
Notice = list[Any]  # [key, *args]
Handler = Callable[..., None]  # handler(agent, sender rank, *args)

_handlers: dict[str, Handler] = {}


def on_notice(key: str, handler: Handler) -> None:
    """Run ``handler(agent, sender_rank, *args)`` for every notice ``key`` received."""
    _handlers[key] = handler


class Notices:
    """The notices an agent has queued, per peer name, and the peers it has told."""

    def __init__(self) -> None:
        self._queued: dict[str, list[Notice]] = {}
        self.told: set[str] = set()  # peers sent a notice since the last delivered()

    def add(self, peer: str, notice: Notice) -> bool:
        """Queue ``notice`` for ``peer``; True if it is the only one queued now."""
        first = not self._queued
        self._queued.setdefault(peer, []).append(notice)
        return first

    def take(self, peer: str) -> list[Notice] | None:
        """What is queued for ``peer`` (then nothing is)."""
        taken = self._queued.pop(peer, None)
        if taken:
            self.told.add(peer)
        return taken

    def take_all(self) -> dict[str, list[Notice]]:
        """Everything queued, by peer (then nothing is)."""
        taken, self._queued = self._queued, {}
        self.told.update(taken)
        return taken

    def __len__(self) -> int:
        return sum(len(queued) for queued in self._queued.values())


def handle(agent: RpcAgent, sender: int, notices: Any) -> None:
    """Run the handler of each notice a frame from ``sender`` carried."""
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
