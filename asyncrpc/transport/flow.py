"""A Link's flow-control policies, sans-IO: when written messages leave, when reading stops.

Theory of operation
-------------------
:class:`WriteCoalescer` decides when a message's byte parts go to the transport.
A message leaves at once, unless the one before it on the link came less than
``within`` seconds earlier in the same loop turn: then it is part of a burst and
waits in the outbox, with the rest of the burst, for the end of the turn (or
until ``max_parts`` parts wait), so that the burst leaves in one ``writelines``.
A message that leaves takes whatever waits along, first, so order is kept.
A small message without buffers that would wait comes as a BATCH *entry*
(``send_entry``, after ``holds_next`` said it would wait): consecutive entries
leave as one BATCH frame, in their place among the burst's other messages, so
the burst's small messages cost one frame's encoding and one parse at the
other end (docs/architecture.md, "Bursts of small messages travel as one
frame").  A batch holds at most ``max_batch_bytes`` of entries.
While writing is paused (the transport's buffer is above its high-water mark,
or there is no transport yet) everything waits; ``resume`` hands it all back.
Its owner tells it when a loop turn that had a message ends (``end_turn``):
``in_turn`` says whether one is under way.  Time comes from an injected clock.

:class:`ReadGate` decides whether the transport reads: not while the owner has
paused the link (a backlog of calls), nor while frames already received still
wait their turn to be handed up (catching up).  Each change of the gate's two
inputs answers whether the transport must be told, so it hears each change once.

Both are plain objects, no asyncio: every sequence of events is unit-testable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from asyncrpc.wire.codec import encode_batch

Parts = list[bytes | memoryview]

COALESCE_WITHIN = 50e-6
"""Seconds: a message this soon after the previous one, in the same loop turn, waits for
the end of the turn with its burst (docs/architecture.md, "Writing without waiting a
turn", says why this long and no longer)."""
FLUSH_PARTS = 64
"""Parts: a burst that has this many waiting leaves without waiting for the turn's end."""
MAX_BATCH_BYTES = 64 * 1024
"""Bytes of entries in one BATCH frame (at most; less if the peer accepts smaller frames:
``max_batch_bytes``); the next entry opens another batch."""
_ARRAY_HEADER = 5
"""Bytes: the most msgpack takes to say how many entries a batch holds."""


class WriteCoalescer:
    """When parts leave; see the module docstring.  Every method returns the parts to
    write now, in order (an empty list: nothing to write)."""

    __slots__ = (
        "_batch_bytes",
        "_entries",
        "_last_message",
        "_outbox",
        "clock",
        "in_turn",
        "max_batch_bytes",
        "max_parts",
        "paused",
        "within",
    )

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        *,
        within: float = COALESCE_WITHIN,
        max_parts: int = FLUSH_PARTS,
        paused: bool = False,
    ) -> None:
        self.clock = clock
        self.within = within
        self.max_parts = max_parts
        self.paused = paused
        self.in_turn = False  # a message came this loop turn; ``end_turn`` is due
        self._outbox: Parts = []
        self._entries: list[bytes] = []  # the open batch: after everything in the outbox
        self._batch_bytes = _ARRAY_HEADER
        self.max_batch_bytes = MAX_BATCH_BYTES
        self._last_message = 0.0

    @property
    def waiting(self) -> int:
        """Parts and batch entries held back."""
        return len(self._outbox) + len(self._entries)

    def holds_next(self) -> bool:
        """Whether a message sent now would wait for its burst (or for ``resume``): then
        a small one may come as an entry (``send_entry``)."""
        return self.paused or self._in_burst(self.clock())

    def fits_batch(self, entry: bytes) -> bool:
        """Whether a BATCH frame can carry ``entry`` (alone, at least)."""
        return _ARRAY_HEADER + len(entry) <= self.max_batch_bytes

    def send_entry(self, entry: bytes) -> Parts:
        """A small message, encoded as a BATCH entry, that ``holds_next`` said would wait
        and that ``fits_batch``: it joins the open batch, or opens the next one if that
        one is full (what to write now: all that waits, once ``max_parts`` do)."""
        self._last_message = self.clock()
        self.in_turn = True
        if self._batch_bytes + len(entry) > self.max_batch_bytes:
            self._close_batch()
        self._entries.append(entry)
        self._batch_bytes += len(entry)
        return self._take() if self.waiting >= self.max_parts else []

    def send(self, parts: Parts) -> Parts:
        """A message to write: now (with what waits before it), or later with its burst."""
        now = self.clock()
        in_burst = self._in_burst(now)
        self._last_message = now
        self.in_turn = True
        if self.paused or in_burst:
            self._close_batch()
            self._outbox.extend(parts)
            return self._take() if len(self._outbox) >= self.max_parts else []
        if self._outbox or self._entries:  # what waits goes first
            parts = [*self.drain(), *parts]
        return parts

    def end_turn(self) -> Parts:
        """The loop turn ended: whatever waits for it leaves."""
        self.in_turn = False
        return self._take()

    def pause(self) -> None:
        """Hold everything until ``resume`` (the transport's buffer is full)."""
        self.paused = True

    def resume(self) -> Parts:
        self.paused = False
        return self._take()

    def drain(self) -> Parts:
        """Everything waiting, paused or not (the transport buffers it: we are closing)."""
        self._close_batch()
        parts, self._outbox = self._outbox, []
        return parts

    def _in_burst(self, now: float) -> bool:
        """Whether a message at ``now`` follows the previous one closely, in this turn."""
        return self.in_turn and now - self._last_message < self.within

    def _close_batch(self) -> None:
        """The open batch's entries, as one BATCH frame, join the outbox."""
        if self._entries:
            self._outbox.append(encode_batch(self._entries))
            self._entries, self._batch_bytes = [], _ARRAY_HEADER

    def _take(self) -> Parts:
        return [] if self.paused else self.drain()


class ReadGate:
    """Whether the transport reads; see the module docstring.  Each method answers
    whether the transport must now be told (to pause for ``pause`` and ``fall_behind``,
    to resume for ``resume`` and ``catch_up``)."""

    __slots__ = ("catching_up", "paused", "reading")

    def __init__(self) -> None:
        self.paused = False  # by the owner
        self.catching_up = False  # received frames wait for their turn
        self.reading = True  # what the transport was last told

    def pause(self) -> bool:
        """The owner stops the frames: hand none up, read no more."""
        self.paused = True
        return self._changed()

    def resume(self) -> bool:
        self.paused = False
        return self._changed()

    def fall_behind(self) -> bool:
        """Received frames are left for a later turn: read no more meanwhile."""
        self.catching_up = True
        return self._changed()

    def catch_up(self) -> bool:
        """Every received frame was handed up."""
        self.catching_up = False
        return self._changed()

    def _changed(self) -> bool:
        want = not (self.paused or self.catching_up)
        if want == self.reading:
            return False
        self.reading = want
        return True
