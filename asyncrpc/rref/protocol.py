"""The RRef reference-counting protocol of one worker, as a pure state machine.

Theory of operation
-------------------
Each RRef has one *owner* (the worker holding its value) and any number of
*users*.  Every user worker holds exactly one *fork* (a unique id the owner
counts) however many Python handles it has; the owner frees the value when its
own handles and all forks are gone.  This module is events in, instructions
out: no asyncio, no sockets, no Python handles, so it can be tested (and
model-checked with hypothesis) on its own.  :mod:`asyncrpc.rref.context` is the
thin shell that feeds it events and carries out its instructions.

Sending a handle to worker ``to`` (it is pickled into a message):

* by the owner: a new fork is registered for ``to`` at once; the receiver is
  confirmed from the start;
* by a user, inside a *request* to the owner: nothing to do.  Our own later
  ``ForkDeleted`` travels on the same link, behind the request, so the owner
  sees the handle before it could free the value;
* by a user, otherwise (to another user, or to the owner inside a reply): a new
  *child* fork is made and the sender's fork is pinned until the child is
  accepted.  A user receiving it asks the owner to count it (``ForkRequest``)
  and, once the owner answered, tells the sender ``ChildAccepted``; the owner
  receiving it tells the sender at once.  Until then the sender's fork keeps
  the value alive, so a fork in flight is never freed early.

A user that already holds a fork of the RRef keeps it and disposes of the new
one (accepts it, or deletes it if the owner made it).  A user fork is deleted
(``ForkDeleted`` to the owner) once it has no handles, no pinned children and
is confirmed.  A lost peer releases the forks it held and the pins waiting on
it; RRefs owned by a lost peer are forgotten.  Every message names its fork, so
receiving one twice changes nothing.

A dead user's pins die with it, so its owner may free an RRef while a child
fork the dead user sent is still on its way.  The owner remembers such RRefs
(``gone``: only those that lost a fork to a dead worker) so that the late fork
is answered without bringing the entry back, and using it fails clearly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

RRefId = tuple[int, int]  # (rank of the worker that made it, serial there)
ForkId = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ForkRequest:
    """User -> owner: count ``fork``, which the sender now holds.  Answered by a reply."""

    rref: RRefId
    fork: ForkId


@dataclass(frozen=True, slots=True)
class ChildAccepted:
    """Child holder (or owner) -> parent: ``fork`` is counted; unpin your own."""

    rref: RRefId
    fork: ForkId


@dataclass(frozen=True, slots=True)
class ForkDeleted:
    """User -> owner: the sender no longer holds ``fork``."""

    rref: RRefId
    fork: ForkId


Message = ForkRequest | ChildAccepted | ForkDeleted


@dataclass(frozen=True, slots=True)
class Send:
    """Instruction: deliver ``message`` to worker ``to``."""

    to: int
    message: Message


@dataclass(frozen=True, slots=True)
class Free:
    """Instruction (owner): nothing refers to ``rref`` any more; drop its value."""

    rref: RRefId


@dataclass(frozen=True, slots=True)
class Orphan:
    """Instruction (owner): ``rref`` was announced by ``creator``, which died before
    asking for its value to be made; fail it."""

    rref: RRefId
    creator: int


Instruction = Send | Free | Orphan


@dataclass(slots=True)
class Owned:
    """An RRef whose value lives here."""

    creator: int
    created: bool = False  # the value has been (or is being) made here
    orphaned: bool = False  # its creator died before asking for it to be made
    exposed: bool = False  # a dead worker held a fork: its unaccepted children may follow
    handles: int = 0  # live Python handles on this worker
    forks: dict[ForkId, int] = field(default_factory=dict)  # fork -> rank holding it


@dataclass(slots=True)
class Held:
    """This worker's fork of an RRef owned elsewhere."""

    owner: int
    fork: ForkId
    confirmed: bool
    handles: int = 0
    children: int = 0  # forks we sent that are not accepted yet (they pin ours)
    to_accept: list[tuple[int, ForkId]] = field(default_factory=list)  # (parent, fork)


class RRefState:
    """The reference-counting state of worker ``rank``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.owned: dict[RRefId, Owned] = {}
        self.held: dict[RRefId, Held] = {}
        self.children: dict[ForkId, tuple[RRefId, int]] = {}  # our pinned children: rref, to
        self.lost: set[int] = set()  # workers known dead
        self.gone: set[RRefId] = set()  # freed after a holder died (see the module doc)
        self._serial = itertools.count()  # from 0, as torch numbers its ids

    def _new_id(self) -> tuple[int, int]:
        return (self.rank, next(self._serial))

    # -- creation ------------------------------------------------------------------

    def create_local(self) -> RRefId:
        """``RRef(value)`` here: an owned RRef with one handle."""
        rref = self._new_id()
        self.owned[rref] = Owned(self.rank, created=True, handles=1)
        return rref

    def create_remote(self, owner: int) -> tuple[RRefId, ForkId]:
        """``remote()`` to another worker: our fork, confirmed when ``owner`` answers."""
        rref, fork = self._new_id(), self._new_id()
        self.held[rref] = Held(owner, fork, confirmed=False, handles=1)
        return rref, fork

    def owner_create(self, rref: RRefId, fork: ForkId | None, creator: int) -> bool:
        """The owner learns of ``remote()``; False if it was already made (a retry)."""
        owned = self.owned.setdefault(rref, Owned(creator))
        if fork is not None:
            owned.forks[fork] = creator
        first = not owned.created
        owned.created = True
        return first

    # -- handles travelling --------------------------------------------------------

    def send(self, rref: RRefId, to: int, in_request: bool) -> ForkId | None:
        """A handle is pickled into a message to ``to``; the fork it carries, if any."""
        owned = self.owned.get(rref)
        if owned is not None:
            fork = self._new_id()
            owned.forks[fork] = to
            return fork
        held = self.held.get(rref)
        if held is None:
            raise KeyError(rref)  # released already: its owner died, or shutdown
        if to == held.owner and in_request:
            return None
        child = self._new_id()
        held.children += 1
        self.children[child] = (rref, to)
        return child

    def unsend(self, rref: RRefId, fork: ForkId | None) -> list[Instruction]:
        """The message carrying ``fork`` was never sent: revert :meth:`send`."""
        if fork is None:
            return []
        owned = self.owned.get(rref)
        if owned is not None:
            owned.forks.pop(fork, None)
            return self._settle(rref)
        return self.child_accepted(rref, fork)

    def receive(
        self, rref: RRefId, owner: int, fork: ForkId | None, parent: int
    ) -> list[Instruction]:
        """A handle arrived from ``parent``; the caller makes one Python handle for it."""
        if owner == self.rank:
            return self._receive_own(rref, fork, parent)
        held = self.held.get(rref)
        if held is None:
            assert fork is not None, "only requests to the owner carry no fork"
            from_owner = parent == owner
            self.held[rref] = Held(owner, fork, confirmed=from_owner, handles=1)
            if from_owner:
                return []
            self.held[rref].to_accept.append((parent, fork))
            return [Send(owner, ForkRequest(rref, fork))]
        held.handles += 1
        if fork is None or fork == held.fork:
            return []
        if parent == owner:  # the owner counted a fork we do not need
            return [Send(owner, ForkDeleted(rref, fork))]
        if held.confirmed:
            return [Send(parent, ChildAccepted(rref, fork))]
        held.to_accept.append((parent, fork))
        return []

    def _receive_own(self, rref: RRefId, fork: ForkId | None, parent: int) -> list[Instruction]:
        owned = self.owned.get(rref)
        if owned is None and rref in self.gone:  # a dead holder's child, too late
            if fork is None or parent == self.rank:
                return []
            return [Send(parent, ChildAccepted(rref, fork))]
        if owned is None:
            if rref[0] == self.rank:
                raise KeyError(rref)  # made here and freed: a protocol violation
            # remote()'s create is still on its way (a reply overtook it): wait for it.
            owned = self.owned[rref] = self._awaiting_create(rref)
        owned.handles += 1
        if fork is None:
            return []
        if parent == self.rank:  # a fork we registered for ourselves
            owned.forks.pop(fork, None)
            return []
        return [Send(parent, ChildAccepted(rref, fork))]

    # -- messages ------------------------------------------------------------------

    def fork_requested(self, rref: RRefId, fork: ForkId, holder: int) -> None:
        """Owner: count ``fork``.  It may arrive before ``remote()``'s own request."""
        if rref in self.gone:
            return  # answered all the same; using the RRef will say it is gone
        if rref not in self.owned:
            self.owned[rref] = self._awaiting_create(rref)
        self.owned[rref].forks[fork] = holder

    def _awaiting_create(self, rref: RRefId) -> Owned:
        return Owned(rref[0], orphaned=rref[0] in self.lost)

    def fork_confirmed(self, rref: RRefId) -> list[Instruction]:
        """The owner answered our ForkRequest (or our ``remote()``)."""
        held = self.held.get(rref)
        if held is None or held.confirmed:
            return []
        held.confirmed = True
        out: list[Instruction] = [Send(p, ChildAccepted(rref, f)) for p, f in held.to_accept]
        held.to_accept.clear()
        return out + self._settle(rref)

    def child_accepted(self, rref: RRefId, fork: ForkId) -> list[Instruction]:
        """A child fork we sent is counted by the owner now: unpin ours."""
        if self.children.pop(fork, None) is None:
            return []
        held = self.held.get(rref)
        if held is not None:
            held.children -= 1
        return self._settle(rref)

    def fork_deleted(self, rref: RRefId, fork: ForkId) -> list[Instruction]:
        """Owner: a user gave up ``fork``."""
        owned = self.owned.get(rref)
        if owned is None or owned.forks.pop(fork, None) is None:
            return []
        return self._settle(rref)

    def handle_dropped(self, rref: RRefId) -> list[Instruction]:
        """One Python handle of ``rref`` here was garbage-collected."""
        entry = self.owned.get(rref) or self.held.get(rref)
        if entry is None:
            return []  # forgotten already (its owner died, or shutdown released it)
        entry.handles -= 1
        return self._settle(rref)

    def _settle(self, rref: RRefId) -> list[Instruction]:
        """Free or delete ``rref`` here if nothing refers to it any more."""
        owned = self.owned.get(rref)
        if owned is not None:
            if owned.handles > 0 or owned.forks or not (owned.created or owned.orphaned):
                return []  # (not created: the creator's fork arrives with the create)
            del self.owned[rref]
            if owned.exposed:
                self.gone.add(rref)
            return [Free(rref)]
        held = self.held.get(rref)
        if held is None or held.handles > 0 or held.children > 0 or not held.confirmed:
            return []
        del self.held[rref]
        return [Send(held.owner, ForkDeleted(rref, held.fork))]

    # -- failures and shutdown -----------------------------------------------------

    def peer_lost(self, rank: int) -> list[Instruction]:
        """Worker ``rank`` is gone: release what it held, forget what it owned."""
        out: list[Instruction] = []
        self.lost.add(rank)
        for rref, owned in list(self.owned.items()):
            for fork in [f for f, holder in owned.forks.items() if holder == rank]:
                del owned.forks[fork]
                owned.exposed = True
            if not owned.created and owned.creator == rank:
                owned.orphaned = True  # it never will be made: fail it, let it be freed
                out.append(Orphan(rref, rank))
        for fork, (rref, to) in list(self.children.items()):
            if to == rank:
                del self.children[fork]
                if rref in self.held:
                    self.held[rref].children -= 1
        for rref, held in list(self.held.items()):
            held.to_accept = [(p, f) for p, f in held.to_accept if p != rank]
            if held.owner == rank:
                del self.held[rref]
                self._forget_children(rref)
        for rref in list(self.owned) + list(self.held):
            out += self._settle(rref)
        return out

    def _forget_children(self, rref: RRefId) -> None:
        for fork in [f for f, (r, _) in self.children.items() if r == rref]:
            del self.children[fork]

    @property
    def settled(self) -> bool:
        """True when every fork we hold is confirmed and none pins a child."""
        return not self.children and all(h.confirmed for h in self.held.values())

    def release_all(self) -> list[Instruction]:
        """Shutdown: give up every fork we hold, whatever handles still exist."""
        out: list[Instruction] = [
            Send(h.owner, ForkDeleted(rref, h.fork)) for rref, h in self.held.items()
        ]
        self.held.clear()
        self.children.clear()
        return out
