"""The agent's lifecycle, and its graceful-shutdown barrier as a sans-IO state machine.

Theory of operation
-------------------
An agent is ``NEW``, ``LISTENING`` once it listens, ``RUNNING`` once it joined the
job, ``DRAINING`` from its first shutdown barrier on, then ``CLOSING`` and
``CLOSED`` (:class:`Lifecycle`; its values are the strings the debug info shows).

Graceful shutdown is two barriers (see :mod:`asyncrpc.agent.agent`).  At phase
``n`` a worker tells every peer "I reached phase n" (a SHUTDOWN frame) and waits
until every peer has told it the same or is dead.  :class:`ShutdownBarrier` is
one worker's side of both phases: events in, actions out, no asyncio and no
sockets, so that every interleaving can be tested (``tests/unit/test_shutdown.py``).
The agent feeds it what happens and carries out what it returns:

* :class:`Reach` ``peer``: find a link shared with ``peer``, or dial one, and
  report :meth:`~ShutdownBarrier.reached` (or :meth:`~ShutdownBarrier.dial_failed`).
  Every phase reaches every peer, the dead included (a peer lost on one link
  may still be alive).  A dial that reached a live worker which did not finish
  the handshake in time (its loop is busy) is retried; any other failed dial
  makes the peer dead.  A peer reached is alive again.
* :class:`Tell` ``link, phases``: send SHUTDOWN for each phase (after the notices
  queued for that peer).  The machine remembers, per link, the phases told on
  it, so a link is never told a phase twice; once every link a peer was told
  on has closed, the next link with it (one it dials, or its announcement
  arriving) is told every phase again: a frame on a closed link may never
  have arrived, and a repeated phase changes nothing.
* :class:`Passed` ``phase``: every peer has announced ``phase`` or is dead, and
  every peer was reached: the phase is complete (reported once).

A peer is dead for the barrier once it is lost (the agent reports
:meth:`~ShutdownBarrier.peer_lost`) or cannot be dialled, unless it already
announced phase 2 (it is finished, not dead); it is alive again once reached or
once it announces a phase, and, before the first phase, once a link with it is
established (a partition healed: the debug info's ``dead_peers`` must not keep it;
once a phase started, a connection alone does not make us wait for it).
:meth:`~ShutdownBarrier.give_up` (the shutdown's time ran out, or the agent closes)
names the peers still missing and ends the machine: it ignores every later event.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from enum import Enum, StrEnum, auto
from typing import Any, Generic, TypeVar

L = TypeVar("L", bound=Hashable)  # a link; the agent's are asyncrpc.transport.Link
PHASES = (1, 2)


class Lifecycle(StrEnum):
    """Where an agent is in its life; each value is the string the debug info shows."""

    NEW = "new"
    LISTENING = "listening"  # start(): its address can be published
    RUNNING = "running"  # join(): it knows every worker; calls may start
    DRAINING = "draining"  # shutting down gracefully: serving, and calls may still start
    CLOSING = "closing"
    CLOSED = "closed"

    usable: bool  # calls may start, and a lost peer matters (read on every call: no property)
    ending: bool  # closing or closed

    def __init__(self, value: str) -> None:
        self.usable = value in ("running", "draining")
        self.ending = value in ("closing", "closed")


class Stage(Enum):
    IDLE = auto()  # no phase started yet: record what peers announce and who is lost
    WAITING = auto()  # phase ``phase`` started: reaching peers, waiting for theirs
    PASSED = auto()  # phase ``phase`` is complete
    GAVE_UP = auto()  # the time ran out, or the agent closes: ignore everything


@dataclass(frozen=True, slots=True)
class Reach:
    """Action: find or dial a link with ``peer``; report reached() or dial_failed()."""

    peer: str


@dataclass(frozen=True, slots=True)
class Tell(Generic[L]):
    """Action: send SHUTDOWN for each of ``phases``, in order, on ``link``."""

    link: L
    phases: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Passed:
    """Action: barrier ``phase`` is complete."""

    phase: int


@dataclass(frozen=True, slots=True)
class GaveUp:
    """What was missing when the time ran out: the peers that had not announced
    ``phase`` (the first phase someone is missing from) and are not dead."""

    phase: int
    missing: tuple[str, ...]


Action = Reach | Tell[L] | Passed


class ShutdownBarrier(Generic[L]):
    """One worker's side of the two shutdown barriers, with the workers ``peers``."""

    def __init__(self, peers: Iterable[str]) -> None:
        self.peers = frozenset(peers)
        self.stage = Stage.IDLE
        self.phase = 0  # the last phase started
        self.announced: dict[int, set[str]] = {phase: set() for phase in PHASES}
        self.dead: set[str] = set()
        self.reaching: set[str] = set()  # peers a Reach is out for
        self._told: dict[L, tuple[str, int]] = {}  # open link -> its peer, last phase told

    # -- events --------------------------------------------------------------------

    def start(self, phase: int) -> list[Action[L]]:
        """We reached ``phase`` (our own calls are done): tell every peer.  Starting a
        phase already started changes nothing."""
        if self.stage is Stage.GAVE_UP or phase <= self.phase:
            return []
        if phase not in PHASES or (phase > 1 and self.stage is not Stage.PASSED):
            raise ValueError(f"cannot start shutdown phase {phase} at {self.stage.name}")
        self.stage, self.phase = Stage.WAITING, phase
        self.reaching = set(self.peers)
        return [*(Reach(peer) for peer in sorted(self.peers)), *self._check()]

    def reached(self, peer: str, link: L) -> list[Action[L]]:
        """A Reach found (or dialled) ``link`` with ``peer``: it is alive."""
        if self.stage is Stage.GAVE_UP or peer not in self.reaching:
            return []
        self.reaching.discard(peer)
        self.dead.discard(peer)  # lost on some link earlier, but alive: wait for it
        return [*self._tell(peer, link), *self._check()]

    def dial_failed(self, peer: str, busy: bool) -> list[Action[L]]:
        """A Reach could not dial ``peer``.  ``busy``: it connected, but the handshake
        timed out (a live worker whose loop is busy): try again.  Else it is dead."""
        if self.stage is Stage.GAVE_UP or peer not in self.reaching:
            return []
        if busy:
            return [Reach(peer)]
        self.reaching.discard(peer)
        self._mark_dead(peer)
        return self._check()

    def peer_announced(self, peer: str, phase: Any, link: L) -> list[Action[L]]:
        """``peer`` sent SHUTDOWN ``phase`` on ``link`` (anything else as a phase is
        ignored).  Alive after all if we thought it dead: it may be waiting for us."""
        if self.stage is Stage.GAVE_UP or phase not in PHASES or peer not in self.peers:
            return []
        self.announced[phase].add(peer)
        self.dead.discard(peer)
        return [*self._tell_if_unheard(peer, link), *self._check()]

    def connected(self, peer: str, link: L) -> list[Action[L]]:
        """A link with ``peer`` was established (dialled by either side); before the
        first phase, a peer lost earlier is alive again."""
        if self.stage is Stage.GAVE_UP or peer not in self.peers:
            return []
        if self.stage is Stage.IDLE:
            self.dead.discard(peer)
        return self._tell_if_unheard(peer, link)

    def link_closed(self, link: L) -> None:
        """``link`` closed: what was told on it may not have arrived (no action)."""
        self._told.pop(link, None)

    def peer_lost(self, peer: str) -> list[Action[L]]:
        """The agent counts ``peer`` as gone (a link with it was lost)."""
        if self.stage is Stage.GAVE_UP or peer not in self.peers:
            return []
        self._mark_dead(peer)
        return self._check()

    def give_up(self) -> GaveUp:
        """The time ran out (or the agent closes): who was missing.  Every later event
        is ignored."""
        self.stage = Stage.GAVE_UP
        first = next((phase for phase in PHASES if self.missing(phase)), PHASES[-1])
        return GaveUp(first, self.missing(first))

    # -- queries -------------------------------------------------------------------

    def missing(self, phase: int) -> tuple[str, ...]:
        """The peers that have neither announced ``phase`` nor are dead, by name."""
        return tuple(sorted(self.peers - self.announced[phase] - self.dead))

    def told(self, link: L) -> int:
        """The last phase told on ``link`` (0: none, or it closed)."""
        entry = self._told.get(link)
        return 0 if entry is None else entry[1]

    # -- helpers -------------------------------------------------------------------

    def _tell(self, peer: str, link: L) -> list[Action[L]]:
        """Every phase started that ``link`` has not been told yet."""
        phases = tuple(range(self.told(link) + 1, self.phase + 1))
        if not phases:
            return []
        self._told[link] = (peer, self.phase)
        return [Tell(link, phases)]

    def _tell_if_unheard(self, peer: str, link: L) -> list[Action[L]]:
        """Tell ``link`` unless an open link was told ``peer``'s due phases already (or a
        Reach, which will, is out for it)."""
        heard = max((told for name, told in self._told.values() if name == peer), default=0)
        if heard >= self.phase or peer in self.reaching:
            return []
        return self._tell(peer, link)

    def _mark_dead(self, peer: str) -> None:
        if peer not in self.announced[2]:  # finished, not dead
            self.dead.add(peer)

    def _check(self) -> list[Action[L]]:
        """Passed, once: every peer reached, and announced the phase or dead."""
        if self.stage is not Stage.WAITING or self.reaching or self.missing(self.phase):
            return []
        self.stage = Stage.PASSED
        return [Passed(self.phase)]
