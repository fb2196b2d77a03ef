"""One message on its way out, and what to undo if it never leaves.

Theory of operation
-------------------
A message can change state before it leaves: a reducer that pickles an RRef
into it registers a fork (see :mod:`asyncrpc.agent.transfer`), and the notices
queued for its peer ride in its header (see :mod:`asyncrpc.agent.notices`).  An
:class:`Outgoing` owns the message from its serialisation on -- kind, header,
payload, buffers, the notices it carries and the undo callbacks of its
reducers -- until one of its two endings:

* :meth:`~Outgoing.sent`: it was handed to its link, which keeps frames in
  order.  Its effects stand, and its notices are delivered as far as the sender
  is concerned (if the link is lost, so is the peer, which then has nothing left
  to handle).
* :meth:`~Outgoing.abandon`: it will never leave -- its call timed out while its
  peer was being dialed, the dial failed, it is too large for the link, the link
  was lost before it was written, or nobody awaits the reply any more.  Its
  reducers' effects are undone, latest first, and its notices are given back to
  the queue they came from, to leave with the next message or a NOTICE frame.

A message with CUDA tensors staged through host memory is not ready to be
written until their copies are done: ``staged`` holds the copies' events, and
:meth:`~Outgoing.wait_staged` waits for them without holding the loop.

The first ending decides; a later one does nothing.  :meth:`~Outgoing.send_on`
and :meth:`~Outgoing.encode_for` end a message themselves when the link refuses
it: abandoned, and the link's error raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from asyncrpc.agent.notices import Notice
from asyncrpc.errors import PeerLostError
from asyncrpc.serde import cuda
from asyncrpc.transport import Link
from asyncrpc.transport.flow import Parts
from asyncrpc.wire import Kind

Undo = Callable[[], None]


class Outgoing:
    """One serialised message for one peer, until it is sent or abandoned."""

    __slots__ = (
        "_ended",
        "_give_back",
        "_notices",
        "_undo",
        "buffers",
        "function",
        "kind",
        "meta",
        "payload",
        "staged",
    )

    def __init__(
        self,
        kind: Kind,
        meta: dict[str, Any],
        payload: bytes = b"",
        buffers: Sequence[memoryview] = (),
        *,
        function: str = "?",
        undo: Sequence[Undo] = (),
    ) -> None:
        # (No list made for the buffers and undo steps most messages lack.)
        self.kind = kind
        self.meta = meta  # the frame's header
        self.payload = payload
        self.buffers = buffers
        self.function = function  # the call it belongs to, named in errors
        self._undo = undo  # owned from now on
        self._notices: list[Notice] = []
        self._give_back: Callable[[list[Notice]], None] | None = None
        self._ended = False
        self.staged: list[Any] = []  # events of CUDA copies still to finish (see module doc)

    @property
    def ready(self) -> bool:
        """Whether it may be written now (its CUDA copies, if any, are done)."""
        if self.staged and cuda.all_done(self.staged):
            self.staged = []
        return not self.staged

    async def wait_staged(self) -> None:
        """Until its CUDA copies are done, waiting in a thread (the loop goes on)."""
        if not self.ready:
            await asyncio.to_thread(cuda.synchronize, self.staged)
            self.staged = []

    def wait_staged_here(self) -> None:
        """Until its CUDA copies are done, blocking this thread (never the loop's)."""
        if self.staged:
            cuda.synchronize(self.staged)
            self.staged = []

    @property
    def size(self) -> int:
        """Bytes of payload and buffers (what the peers' ``max_frame_size`` limits)."""
        if not self.buffers:  # most messages (a generator costs more than the sum)
            return len(self.payload)
        return len(self.payload) + sum(b.nbytes for b in self.buffers)

    @property
    def call_id(self) -> int | None:
        """The call this message belongs to, if any."""
        call_id = self.meta.get("i")
        return call_id if type(call_id) is int else None

    def carry(self, notices: list[Notice], give_back: Callable[[list[Notice]], None]) -> None:
        """Carry ``notices`` in the header; ``give_back(notices)`` if it never leaves."""
        if notices:
            self.meta["n"] = self._notices = notices
            self._give_back = give_back

    def send_on(self, link: Link) -> None:
        """Hand it to ``link`` (loop thread only): then it is sent.  If the link refuses
        it (too large, or lost), it is abandoned and the link's error raised."""
        try:
            send_unless_lost(
                link, self.kind, self.meta, self.payload, self.buffers, function=self.function
            )
        except BaseException:
            self.abandon()
            raise
        self.sent()

    def encode_for(self, link: Link) -> Parts:
        """Its bytes for ``link`` (any thread; see ``Link.encode``), to be written with
        ``link.write`` and then marked sent.  If the link refuses it, it is abandoned
        and the link's error raised.  The buffers are let go once encoded: the parts
        hold what is still to be written, and a buffer copied into shared memory can
        die (releasing the segment it may live in) before the message leaves."""
        try:
            parts = link.encode(
                self.kind, self.meta, self.payload, self.buffers, function=self.function
            )
        except BaseException:
            self.abandon()
            raise
        self.buffers = []
        return parts

    def sent(self) -> None:
        """It left: its effects stand and its notices are delivered."""
        self._ended = True

    def abandon(self) -> None:
        """It will never leave: undo its reducers' effects (latest first) and give its
        notices back, to go first with the next message to its peer."""
        if self._ended:
            return
        self._ended = True
        undo, self._undo = self._undo, ()
        try:
            undo_all(undo)
        finally:
            if self._notices and self._give_back is not None:
                self._give_back(self._notices)


def undo_all(undo: Sequence[Undo]) -> None:
    """Undo the effects a message's reducers had, latest first (it never leaves)."""
    for step in reversed(undo):
        step()


def send_unless_lost(
    link: Link,
    kind: int,
    meta: dict[str, Any],
    payload: bytes,
    buffers: Sequence[memoryview] = (),
    *,
    function: str,
) -> None:
    """``link.send`` (loop thread only), refused with ``PeerLostError`` once the link
    is lost: for an :class:`Outgoing`, and for a plain message that needs none."""
    if link.closed:
        raise PeerLostError(f"{link!r} was lost before the message was written")
    link.send(kind, meta, payload, buffers, function=function)
