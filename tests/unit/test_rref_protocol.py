"""Unit tests of the RRef reference-counting state machine (asyncrpc.rref.protocol).

The protocol is pure (events in, instructions out), so these tests drive
:class:`RRefState` objects by hand: first short scenarios, then a hypothesis
model of three workers whose messages travel on FIFO lanes that interleave
arbitrarily, as on the real links.  For each ordered pair of workers
(src, dst) there is a REQUEST lane (requests src sends to dst, on the link src
dialed) and a REPLY lane (replies src sends back to dst, on the link dst
dialed).  Protocol messages and ``remote()``'s create are requests; the answer
to a ForkRequest or a create, which confirms the requester's fork, is a reply.
Last, an exhaustive search walks every interleaving of a few sends (and a death)
of one RRef: slower per state, but it misses nothing within its scope.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asyncrpc.rref.protocol import (
    ChildAccepted,
    ForkDeleted,
    ForkId,
    ForkRequest,
    Free,
    Held,
    Instruction,
    Message,
    Orphan,
    RRefId,
    RRefState,
    Send,
)

A, B, C = 0, 1, 2

# -- helpers ---------------------------------------------------------------------------


def snapshot(*states: RRefState) -> Any:
    """Everything the protocol counts on these workers (for "nothing changed" checks)."""
    return copy.deepcopy([(s.owned, s.held, s.children, s.gone) for s in states])


STATE_FIELDS = {"rank", "owned", "held", "children", "lost", "gone", "_serial"}


def clone_state(state: RRefState) -> RRefState:
    """An independent copy of ``state`` (deepcopy is too slow for the exhaustive search)."""
    assert set(vars(state)) == STATE_FIELDS, "RRefState changed: update clone_state"
    other = object.__new__(RRefState)
    other.__dict__.update(vars(state))
    other.owned = {r: replace(o, forks=o.forks.copy()) for r, o in state.owned.items()}
    other.held = {r: replace(h, to_accept=h.to_accept.copy()) for r, h in state.held.items()}
    other.children = state.children.copy()
    other.lost = state.lost.copy()
    other.gone = state.gone.copy()
    serial = next(state._serial)
    state._serial, other._serial = itertools.count(serial), itertools.count(serial)
    return other


def send_fork(state: RRefState, rref: RRefId, to: int, in_request: bool = True) -> ForkId:
    """``state.send(...)``, which must make a fork for the message."""
    fork = state.send(rref, to, in_request)
    assert fork is not None
    return fork


def is_empty(state: RRefState) -> bool:
    return not state.owned and not state.held and not state.children


def remote_created(creator: RRefState, owner: RRefState) -> tuple[RRefId, ForkId]:
    """``remote()`` from ``creator`` to ``owner``, its create handled and answered."""
    rref, fork = creator.create_remote(owner.rank)
    assert owner.owner_create(rref, fork, creator.rank)
    assert creator.fork_confirmed(rref) == []
    return rref, fork


# -- creation and dropping ---------------------------------------------------------------


def test_local_create_and_drop_frees() -> None:
    owner = RRefState(A)
    rref = owner.create_local()
    assert rref == (A, 0)  # ids count from 0 on each worker, as torch's do
    assert owner.create_remote(B) == ((A, 1), (A, 2))  # one serial for RRefs and forks
    del owner.held[(A, 1)]
    assert owner.owned[rref].handles == 1 and owner.owned[rref].created
    assert owner.handle_dropped(rref) == [Free(rref)]
    assert is_empty(owner)
    assert owner.handle_dropped(rref) == []  # a late drop of a forgotten RRef is harmless


def test_owner_frees_only_when_its_last_handle_dies() -> None:
    owner = RRefState(A)
    rref = owner.create_local()
    fork = send_fork(owner, rref, A)  # e.g. an RPC to itself
    assert owner.receive(rref, A, fork, parent=A) == []
    assert owner.owned[rref].handles == 2 and owner.owned[rref].forks == {}
    assert owner.handle_dropped(rref) == []
    assert owner.handle_dropped(rref) == [Free(rref)]


def test_owner_sends_to_a_user_which_drops_it() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    fork = send_fork(owner, rref, B, in_request=False)
    assert owner.owned[rref].forks == {fork: B}
    assert user.receive(rref, A, fork, parent=A) == []
    assert user.held[rref] == Held(A, fork, confirmed=True, handles=1)
    assert user.settled
    assert owner.handle_dropped(rref) == []  # the user's fork keeps the value
    assert user.handle_dropped(rref) == [Send(A, ForkDeleted(rref, fork))]
    assert is_empty(user)
    assert owner.fork_deleted(rref, fork) == [Free(rref)]
    assert is_empty(owner)


def test_remote_confirms_the_creator_fork_when_answered() -> None:
    creator, owner = RRefState(A), RRefState(B)
    rref, fork = creator.create_remote(B)
    assert creator.held[rref] == Held(B, fork, confirmed=False, handles=1)
    assert not creator.settled
    assert creator.handle_dropped(rref) == []  # unconfirmed: the create is still on its way
    assert owner.owner_create(rref, fork, A)
    assert not owner.owner_create(rref, fork, A)  # a retry does not make it twice
    assert owner.owned[rref].forks == {fork: A}
    assert creator.fork_confirmed(rref) == [Send(B, ForkDeleted(rref, fork))]
    assert owner.fork_deleted(rref, fork) == [Free(rref)]
    assert is_empty(creator) and is_empty(owner)


def test_a_user_forks_to_another_user() -> None:
    owner, parent, child = RRefState(A), RRefState(B), RRefState(C)
    rref = owner.create_local()
    parent_fork = send_fork(owner, rref, B)
    parent.receive(rref, A, parent_fork, parent=A)
    assert owner.handle_dropped(rref) == []

    fork = send_fork(parent, rref, C)
    assert parent.held[rref].children == 1
    assert parent.children == {fork: (rref, C)}
    assert not parent.settled
    assert parent.handle_dropped(rref) == []  # pinned by its child
    assert child.receive(rref, A, fork, parent=B) == [Send(A, ForkRequest(rref, fork))]
    assert child.held[rref] == Held(A, fork, confirmed=False, handles=1, to_accept=[(B, fork)])
    owner.fork_requested(rref, fork, C)
    assert owner.owned[rref].forks == {parent_fork: B, fork: C}
    assert child.fork_confirmed(rref) == [Send(B, ChildAccepted(rref, fork))]
    assert child.held[rref].to_accept == []
    assert parent.child_accepted(rref, fork) == [Send(A, ForkDeleted(rref, parent_fork))]
    assert is_empty(parent)
    assert owner.fork_deleted(rref, parent_fork) == []  # the child still holds one
    assert child.handle_dropped(rref) == [Send(A, ForkDeleted(rref, fork))]
    assert owner.fork_deleted(rref, fork) == [Free(rref)]
    assert is_empty(owner) and is_empty(child)


def test_a_child_dropped_before_it_is_confirmed_waits_for_the_owner() -> None:
    owner, parent, child = RRefState(A), RRefState(B), RRefState(C)
    rref, _ = remote_created(parent, owner)
    fork = send_fork(parent, rref, C, in_request=False)
    child.receive(rref, A, fork, parent=B)
    assert child.handle_dropped(rref) == []  # not counted yet: deleting it would be lost
    owner.fork_requested(rref, fork, C)
    assert child.fork_confirmed(rref) == [
        Send(B, ChildAccepted(rref, fork)),
        Send(A, ForkDeleted(rref, fork)),
    ]
    assert owner.fork_deleted(rref, fork) == []


# -- a user sends a handle to the owner ------------------------------------------------


def test_a_user_returns_a_handle_to_the_owner_in_a_reply() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user_fork = send_fork(owner, rref, B)
    user.receive(rref, A, user_fork, parent=A)
    assert owner.handle_dropped(rref) == []

    child = send_fork(user, rref, A, in_request=False)  # a reply may overtake our ForkDeleted
    assert user.held[rref].children == 1
    assert user.handle_dropped(rref) == []  # pinned until the owner has the handle
    assert owner.receive(rref, A, child, parent=B) == [Send(B, ChildAccepted(rref, child))]
    assert owner.owned[rref].handles == 1
    assert child not in owner.owned[rref].forks  # the owner counts a handle, not a fork
    assert user.child_accepted(rref, child) == [Send(A, ForkDeleted(rref, user_fork))]
    assert owner.fork_deleted(rref, user_fork) == []  # its own handle keeps it
    assert owner.handle_dropped(rref) == [Free(rref)]


def test_a_user_sends_a_handle_to_the_owner_in_a_request_without_a_fork() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user_fork = send_fork(owner, rref, B)
    user.receive(rref, A, user_fork, parent=A)
    owner.handle_dropped(rref)

    assert user.send(rref, A, in_request=True) is None  # our ForkDeleted follows it
    assert user.children == {} and user.held[rref].children == 0
    assert user.handle_dropped(rref) == [Send(A, ForkDeleted(rref, user_fork))]
    assert owner.receive(rref, A, None, parent=B) == []  # delivered first: same lane
    assert owner.fork_deleted(rref, user_fork) == []
    assert owner.handle_dropped(rref) == [Free(rref)]


def test_a_fork_request_may_arrive_before_the_create() -> None:
    creator, owner, user = RRefState(A), RRefState(B), RRefState(C)
    rref, creator_fork = creator.create_remote(B)
    fork = send_fork(creator, rref, C)
    assert user.receive(rref, B, fork, parent=A) == [Send(B, ForkRequest(rref, fork))]
    owner.fork_requested(rref, fork, C)  # overtakes the create, on another lane
    assert owner.owned[rref].forks == {fork: C} and not owner.owned[rref].created
    assert owner.owned[rref].creator == A
    assert owner.owner_create(rref, creator_fork, A)  # the value is still to be made
    assert owner.owned[rref].forks == {fork: C, creator_fork: A}
    assert user.fork_confirmed(rref) == [Send(A, ChildAccepted(rref, fork))]
    assert creator.child_accepted(rref, fork) == []  # still unconfirmed itself
    assert creator.handle_dropped(rref) == []
    assert creator.fork_confirmed(rref) == [Send(B, ForkDeleted(rref, creator_fork))]


# -- dedupe: one fork per worker -------------------------------------------------------


def test_a_second_fork_from_the_owner_is_deleted() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    first = send_fork(owner, rref, B)
    second = send_fork(owner, rref, B, in_request=False)
    assert first != second
    assert user.receive(rref, A, first, parent=A) == []
    assert user.receive(rref, A, second, parent=A) == [Send(A, ForkDeleted(rref, second))]
    assert user.held[rref].fork == first and user.held[rref].handles == 2
    assert owner.fork_deleted(rref, second) == []
    assert owner.owned[rref].forks == {first: B}


def test_a_second_fork_from_a_user_is_accepted_at_once_when_confirmed() -> None:
    owner, parent, user = RRefState(A), RRefState(B), RRefState(C)
    rref = owner.create_local()
    parent.receive(rref, A, send_fork(owner, rref, B), parent=A)
    user_fork = send_fork(owner, rref, C)
    user.receive(rref, A, user_fork, parent=A)

    child = send_fork(parent, rref, C)
    assert user.receive(rref, A, child, parent=B) == [Send(B, ChildAccepted(rref, child))]
    assert user.held[rref].fork == user_fork and user.held[rref].handles == 2
    assert parent.child_accepted(rref, child) == []
    assert parent.children == {} and parent.held[rref].children == 0


def test_a_second_fork_from_a_user_is_accepted_once_ours_is_confirmed() -> None:
    owner, creator, user = RRefState(A), RRefState(B), RRefState(C)
    rref, _ = remote_created(creator, owner)
    first = send_fork(creator, rref, C)
    second = send_fork(creator, rref, C, in_request=False)
    assert user.receive(rref, A, first, parent=B) == [Send(A, ForkRequest(rref, first))]
    assert user.receive(rref, A, second, parent=B) == []  # deferred: ours is not counted
    assert user.held[rref].to_accept == [(B, first), (B, second)]
    owner.fork_requested(rref, first, C)
    assert user.fork_confirmed(rref) == [
        Send(B, ChildAccepted(rref, first)),
        Send(B, ChildAccepted(rref, second)),
    ]
    assert owner.owned[rref].forks[first] == C and second not in owner.owned[rref].forks


def test_a_handle_sent_by_a_user_to_itself_is_accepted() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user.receive(rref, A, send_fork(owner, rref, B), parent=A)
    child = send_fork(user, rref, B)
    assert user.receive(rref, A, child, parent=B) == [Send(B, ChildAccepted(rref, child))]
    assert user.child_accepted(rref, child) == []
    assert user.held[rref].handles == 2 and user.settled


# -- idempotence -------------------------------------------------------------------------


def test_every_message_delivered_twice_changes_nothing() -> None:
    owner, parent, child = RRefState(A), RRefState(B), RRefState(C)
    rref = owner.create_local()
    parent_fork = send_fork(owner, rref, B)
    parent.receive(rref, A, parent_fork, parent=A)
    owner.handle_dropped(rref)
    fork = send_fork(parent, rref, C)
    child.receive(rref, A, fork, parent=B)

    def twice(step: Any, *args: Any) -> Any:
        first = step(*args)
        before = snapshot(owner, parent, child)
        assert step(*args) in (None, [])
        assert snapshot(owner, parent, child) == before
        return first

    twice(owner.fork_requested, rref, fork, C)
    assert twice(child.fork_confirmed, rref) == [Send(B, ChildAccepted(rref, fork))]
    assert twice(parent.child_accepted, rref, fork) == []
    assert parent.handle_dropped(rref) == [Send(A, ForkDeleted(rref, parent_fork))]
    assert twice(owner.fork_deleted, rref, parent_fork) == []
    assert child.handle_dropped(rref) == [Send(A, ForkDeleted(rref, fork))]
    assert twice(owner.fork_deleted, rref, fork) == [Free(rref)]
    assert is_empty(owner) and is_empty(parent) and is_empty(child)


def test_messages_about_unknown_rrefs_are_ignored() -> None:
    state = RRefState(A)
    ghost, fork = (B, 7), (C, 9)
    assert state.fork_confirmed(ghost) == []
    assert state.child_accepted(ghost, fork) == []
    assert state.fork_deleted(ghost, fork) == []
    assert state.handle_dropped(ghost) == []
    assert is_empty(state)


# -- unsend ----------------------------------------------------------------------------


def test_unsend_by_the_owner_forgets_the_fork() -> None:
    owner = RRefState(A)
    rref = owner.create_local()
    fork = send_fork(owner, rref, B)
    assert owner.unsend(rref, fork) == []  # our own handle still keeps it
    assert owner.owned[rref].forks == {}
    assert owner.handle_dropped(rref) == [Free(rref)]


def test_unsend_by_the_owner_frees_if_the_handle_died_meanwhile() -> None:
    owner = RRefState(A)
    rref = owner.create_local()
    fork = send_fork(owner, rref, B)
    assert owner.handle_dropped(rref) == []  # the fork in flight keeps it
    assert owner.unsend(rref, fork) == [Free(rref)]


def test_unsend_by_a_user_unpins_its_fork() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user_fork = send_fork(owner, rref, B)
    user.receive(rref, A, user_fork, parent=A)
    child = send_fork(user, rref, C, in_request=False)
    assert user.handle_dropped(rref) == []
    assert user.unsend(rref, child) == [Send(A, ForkDeleted(rref, user_fork))]
    assert is_empty(user)


def test_unsend_of_a_request_to_the_owner_does_nothing() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user.receive(rref, A, send_fork(owner, rref, B), parent=A)
    before = snapshot(user)
    fork = user.send(rref, A, in_request=True)
    assert fork is None
    assert user.unsend(rref, fork) == []
    assert snapshot(user) == before


# -- failures and shutdown -------------------------------------------------------------


def test_peer_lost_of_a_user_releases_its_forks_and_the_pins_waiting_on_it() -> None:
    owner, parent = RRefState(A), RRefState(B)
    rref = owner.create_local()
    parent.receive(rref, A, send_fork(owner, rref, B), parent=A)
    send_fork(owner, rref, C)  # a fork the lost worker holds (or was sent)
    owner.handle_dropped(rref)
    send_fork(parent, rref, C)  # a child the lost worker never accepts
    assert parent.handle_dropped(rref) == []
    assert len(owner.owned[rref].forks) == 2

    (parent_fork,) = [f for f, holder in owner.owned[rref].forks.items() if holder == B]
    assert parent.peer_lost(C) == [Send(A, ForkDeleted(rref, parent_fork))]
    assert is_empty(parent)
    assert owner.peer_lost(C) == []
    assert owner.owned[rref].forks == {parent_fork: B}
    assert owner.fork_deleted(rref, parent_fork) == [Free(rref)]


def test_peer_lost_of_a_parent_drops_the_deferred_acceptance() -> None:
    owner, creator, user = RRefState(A), RRefState(B), RRefState(C)
    rref, _ = remote_created(creator, owner)
    fork = send_fork(creator, rref, C)
    user.receive(rref, A, fork, parent=B)
    assert user.held[rref].to_accept == [(B, fork)]
    assert user.peer_lost(B) == []
    assert user.held[rref].to_accept == []
    owner.fork_requested(rref, fork, C)
    assert user.fork_confirmed(rref) == []  # nobody to tell


def test_peer_lost_of_the_creator_before_its_create_orphans_the_rref() -> None:
    creator, owner, user = RRefState(A), RRefState(B), RRefState(C)
    rref, _ = creator.create_remote(B)
    fork = send_fork(creator, rref, C)
    user.receive(rref, B, fork, parent=A)
    owner.fork_requested(rref, fork, C)  # the create is lost with its creator
    assert owner.peer_lost(A) == [Orphan(rref, A)]
    assert owner.owned[rref].forks == {fork: C}  # the user may still ask, and be told
    assert user.fork_confirmed(rref) == [Send(A, ChildAccepted(rref, fork))]
    assert user.peer_lost(A) == []
    assert user.handle_dropped(rref) == [Send(B, ForkDeleted(rref, fork))]
    assert owner.fork_deleted(rref, fork) == [Free(rref)]


def test_peer_lost_of_a_creator_after_its_create_orphans_nothing() -> None:
    creator, owner = RRefState(A), RRefState(B)
    rref, _ = remote_created(creator, owner)
    assert owner.peer_lost(A) == [Free(rref)]  # its fork was the only reference
    assert is_empty(owner)


def test_peer_lost_of_the_owner_forgets_its_rrefs() -> None:
    owner, user, other = RRefState(A), RRefState(B), RRefState(C)
    rref, _ = remote_created(user, owner)
    mine = user.create_local()
    pending = send_fork(user, rref, C)  # pinned child of the lost owner's RRef
    other.receive(rref, A, pending, parent=B)
    assert user.peer_lost(A) == []
    assert rref not in user.held and user.children == {}
    assert user.owned[mine].handles == 1  # its own RRefs are untouched
    assert other.peer_lost(A) == []
    assert is_empty(other)
    assert user.handle_dropped(rref) == []  # the handle outlives its owner harmlessly
    assert other.fork_confirmed(rref) == []


def test_peer_lost_twice_changes_nothing() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user.receive(rref, A, send_fork(owner, rref, B), parent=A)
    send_fork(owner, rref, C)
    owner.peer_lost(C)
    user.peer_lost(C)
    before = snapshot(owner, user)
    assert owner.peer_lost(C) == [] and user.peer_lost(C) == []
    assert snapshot(owner, user) == before


def test_release_all_gives_up_every_fork_once_settled() -> None:
    owner, user = RRefState(A), RRefState(B)
    local = owner.create_local()
    fork = send_fork(owner, local, B)
    user.receive(local, A, fork, parent=A)
    made, made_fork = user.create_remote(A)
    assert not user.settled  # remote() not answered yet
    assert owner.owner_create(made, made_fork, B)
    user.fork_confirmed(made)
    assert user.settled and owner.settled

    out = user.release_all()  # whatever Python handles remain
    assert sorted(out, key=repr) == sorted(
        [Send(A, ForkDeleted(local, fork)), Send(A, ForkDeleted(made, made_fork))], key=repr
    )
    assert is_empty(user)
    assert owner.fork_deleted(local, fork) == []  # the owner's handle remains
    assert owner.fork_deleted(made, made_fork) == [Free(made)]
    assert list(owner.owned) == [local]
    assert owner.release_all() == []  # owned values are not forks


def test_a_pinned_child_is_not_settled() -> None:
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user.receive(rref, A, send_fork(owner, rref, B), parent=A)
    child = send_fork(user, rref, C)
    assert not user.settled
    user.child_accepted(rref, child)
    assert user.settled


# -- remote()'s create overtaken by other messages ---------------------------------------


def test_the_owner_receives_its_rref_before_the_create() -> None:
    """A calls remote(B) inside a call from B and returns the handle: the reply (A->B
    REPLY lane) overtakes the create (A->B REQUEST lane)."""
    creator, owner = RRefState(A), RRefState(B)
    rref, creator_fork = creator.create_remote(B)
    child = send_fork(creator, rref, B, in_request=False)
    assert owner.receive(rref, B, child, parent=A) == [Send(A, ChildAccepted(rref, child))]
    assert owner.handle_dropped(rref) == []  # the create is still on its way
    assert rref in owner.owned
    assert owner.owner_create(rref, creator_fork, A)
    assert creator.child_accepted(rref, child) == []
    assert creator.handle_dropped(rref) == []
    assert creator.fork_confirmed(rref) == [Send(B, ForkDeleted(rref, creator_fork))]
    assert owner.fork_deleted(rref, creator_fork) == [Free(rref)]


def test_the_owner_does_not_free_before_the_create() -> None:
    """A fork request overtakes remote()'s create; that fork is deleted before the create
    arrives, while the creator still holds a handle: the owner must keep the RRef."""
    creator, owner, user = RRefState(A), RRefState(B), RRefState(C)
    rref, creator_fork = creator.create_remote(B)
    fork = send_fork(creator, rref, C)
    user.receive(rref, B, fork, parent=A)
    owner.fork_requested(rref, fork, C)
    assert user.fork_confirmed(rref) == [Send(A, ChildAccepted(rref, fork))]
    assert creator.child_accepted(rref, fork) == []
    assert user.handle_dropped(rref) == [Send(B, ForkDeleted(rref, fork))]
    assert creator.held[rref].handles == 1
    assert owner.fork_deleted(rref, fork) == []
    assert owner.owner_create(rref, creator_fork, A)  # made once, now
    assert owner.owned[rref].forks == {creator_fork: A}


def test_a_fork_request_after_its_creator_was_lost_can_be_freed() -> None:
    creator, owner, user = RRefState(A), RRefState(B), RRefState(C)
    rref, _ = creator.create_remote(B)
    fork = send_fork(creator, rref, C)
    user.receive(rref, B, fork, parent=A)
    assert owner.peer_lost(A) == []  # it has not heard of the RRef yet
    owner.fork_requested(rref, fork, C)  # the create never comes
    assert owner.fork_deleted(rref, fork) == [Free(rref)]


def test_a_fork_request_after_its_parent_died_leaks_nothing() -> None:
    """B forwards A's RRef to C and dies before C's ForkRequest reaches A.  A frees the
    RRef when it loses B (B's pin on the child died with it: accepted), then the late
    ForkRequest makes a new entry that waits for a create that never comes."""
    owner, parent, user = RRefState(A), RRefState(B), RRefState(C)
    rref = owner.create_local()
    parent.receive(rref, A, send_fork(owner, rref, B), parent=A)
    assert owner.handle_dropped(rref) == []
    fork = send_fork(parent, rref, C)
    assert user.receive(rref, A, fork, parent=B) == [Send(A, ForkRequest(rref, fork))]
    assert owner.peer_lost(B) == [Free(rref)]
    assert user.peer_lost(B) == []
    owner.fork_requested(rref, fork, C)
    assert user.fork_confirmed(rref) == []
    assert user.handle_dropped(rref) == [Send(A, ForkDeleted(rref, fork))]
    owner.fork_deleted(rref, fork)
    assert is_empty(owner), owner.owned
    assert rref in owner.gone  # so using it says why it is not there


def test_a_dead_parents_child_coming_back_to_the_owner_is_accepted() -> None:
    """As above, but C passes its handle back to A (in a reply) after A freed the RRef:
    A accepts the child, so C unpins its fork and settles, and A counts nothing."""
    owner, parent, user = RRefState(A), RRefState(B), RRefState(C)
    rref = owner.create_local()
    parent.receive(rref, A, send_fork(owner, rref, B), parent=A)
    owner.handle_dropped(rref)
    fork = send_fork(parent, rref, C)
    user.receive(rref, A, fork, parent=B)
    assert owner.peer_lost(B) == [Free(rref)]
    user.peer_lost(B)
    child = send_fork(user, rref, A, in_request=False)
    assert owner.receive(rref, A, child, parent=C) == [Send(C, ChildAccepted(rref, child))]
    assert owner.handle_dropped(rref) == []  # a handle of nothing: dropping it is a no-op
    assert user.child_accepted(rref, child) == []
    owner.fork_requested(rref, fork, C)
    assert user.fork_confirmed(rref) == []
    assert user.handle_dropped(rref) == [Send(A, ForkDeleted(rref, fork))]
    assert owner.fork_deleted(rref, fork) == []
    assert is_empty(owner) and is_empty(user) and user.settled


def test_a_released_fork_cannot_be_sent() -> None:
    """Once the owner died, the user's fork is forgotten: pickling a handle fails."""
    owner, user = RRefState(A), RRefState(B)
    rref = owner.create_local()
    user.receive(rref, A, send_fork(owner, rref, B), parent=A)
    user.peer_lost(A)
    with pytest.raises(KeyError):
        user.send(rref, C, in_request=False)


# -- the model: three workers and their lanes ---------------------------------------------

RANKS = (A, B, C)
REQUEST, REPLY = "request", "reply"
Lane = tuple[int, int, str]  # (src, dst, REQUEST or REPLY)


@dataclass(frozen=True)
class Carrier:
    """A user message carrying one pickled handle."""

    rref: RRefId
    owner: int
    fork: ForkId | None
    parent: int


@dataclass(frozen=True)
class Create:
    """``remote()``'s request to the owner."""

    rref: RRefId
    fork: ForkId


@dataclass(frozen=True)
class Confirmed:
    """The reply to a ForkRequest or a create (or its failure): confirms the fork."""

    rref: RRefId


Wire = Carrier | Create | Confirmed | Message
IDEMPOTENT = (Confirmed, ForkRequest, ChildAccepted, ForkDeleted)


class Cluster:
    """Three workers, their Python handles and every message in flight: the world that
    the hypothesis model and the exhaustive search both drive, and its checks.

    Safety: an RRef that a live worker holds a handle to, or that a message in flight
    carries, is never freed by its live owner.  A dead worker waives it for the RRefs it
    owned and for those it had sent a child fork of that was not accepted yet (its pin
    died with it).  Liveness: once everything is delivered and every handle dropped, the
    survivors hold nothing.
    """

    def __init__(self) -> None:
        self.states = [RRefState(rank) for rank in RANKS]
        self.alive = set(RANKS)
        self.handles = [Counter[RRefId]() for _ in RANKS]  # Python handles per worker
        self.lanes: dict[Lane, deque[Wire]] = {
            (src, dst, kind): deque() for src in RANKS for dst in RANKS for kind in (REQUEST, REPLY)
        }
        self.owner_of: dict[RRefId, int] = {}
        self.uncreated: set[RRefId] = set()  # remote() whose create the owner has not had
        self.making: list[tuple[int, int, RRefId]] = []  # (owner, creator, rref) unanswered
        self.exposed: set[RRefId] = set()  # safety waived: their owner or a pin died
        self.shut = False

    # -- what is where -----------------------------------------------------------------

    def holdings(self, live_owner: bool = True) -> list[tuple[int, RRefId]]:
        """(worker, rref) for each live Python handle (of RRefs whose owner is alive and
        still has them: an owner's handle of an RRef ``gone`` can only be dropped)."""
        return sorted(
            (w, rref)
            for w in sorted(self.alive)
            for rref, n in self.handles[w].items()
            if n > 0 and (not live_owner or self._usable(w, rref))
        )

    def _usable(self, w: int, rref: RRefId) -> bool:
        owner = self.owner_of[rref]
        return owner in self.alive and not (owner == w and rref in self.states[w].gone)

    def referenced(self) -> set[RRefId]:
        """RRefs a live worker holds a handle to, or a message in flight carries."""
        held = {rref for w, rref in self.holdings(live_owner=False)}
        for (_, dst, _), lane in self.lanes.items():
            if dst in self.alive:
                held |= {m.rref for m in lane if isinstance(m, (Carrier, Create))}
        return held

    def deliverable(self, kind: str | None = None) -> list[Lane]:
        return [
            lane
            for lane, queue in self.lanes.items()
            if queue and lane[1] in self.alive and kind in (None, lane[2])
        ]

    def key(self) -> str:
        """The whole state, canonically (for the exhaustive search)."""
        workers = [
            (
                *(sorted(d.items()) for d in (s.owned, s.held, s.children)),
                sorted(s.lost),
                sorted(s.gone),
            )
            for s in self.states
        ]
        serials = [repr(s._serial) for s in self.states]  # the next ids
        lanes = sorted((lane, list(q)) for lane, q in self.lanes.items() if q)
        handles = [sorted(+h) for h in self.handles]
        sets = [sorted(x) for x in (self.alive, self.uncreated, self.exposed)]
        return repr((workers, serials, lanes, handles, sorted(self.making), sets))

    def clone(self) -> Cluster:
        """An independent copy (much faster than deepcopy; messages are immutable)."""
        other = object.__new__(Cluster)
        other.__dict__.update(vars(self))
        other.states = [clone_state(s) for s in self.states]
        other.handles = [h.copy() for h in self.handles]
        other.lanes = {lane: deque(q) for lane, q in self.lanes.items()}
        other.owner_of = self.owner_of.copy()
        other.making = self.making.copy()
        for name in ("alive", "uncreated", "exposed"):
            setattr(other, name, set(getattr(self, name)))
        return other

    # -- instructions and messages -----------------------------------------------------

    def _post(self, src: int, to: int, message: Message) -> None:
        if to in self.alive:
            self.lanes[(src, to, REQUEST)].append(message)
        elif isinstance(message, ForkRequest):  # the call fails: the shell confirms anyway
            self.lanes[(to, src, REPLY)].append(Confirmed(message.rref))

    def _carry_out(self, w: int, out: list[Instruction]) -> None:
        for instruction in out:
            if isinstance(instruction, Send):
                self._post(w, instruction.to, instruction.message)
            elif isinstance(instruction, Free):
                self._check_free(w, instruction.rref)
            else:
                self._check_orphan(w, instruction)

    def _check_free(self, w: int, rref: RRefId) -> None:
        assert self.owner_of[rref] == w and rref not in self.states[w].owned
        if not self.shut and rref not in self.exposed:
            assert rref not in self.referenced(), f"{rref} freed while still referenced"

    def _check_orphan(self, w: int, orphan: Orphan) -> None:
        owned = self.states[w].owned.get(orphan.rref)  # (freed in the same step, maybe)
        assert orphan.creator not in self.alive and orphan.rref in self.uncreated
        assert owned is None or not owned.created

    def _receive(self, src: int, dst: int, message: Wire) -> list[Instruction]:
        """Apply one delivered message at ``dst``; the instructions it gives."""
        state = self.states[dst]
        if isinstance(message, Carrier):
            return self._receive_handle(dst, message)
        if isinstance(message, Create):
            assert state.owner_create(message.rref, message.fork, message.rref[0])
            self.uncreated.discard(message.rref)
            self.making.append((dst, src, message.rref))
            return []
        if isinstance(message, ForkRequest):
            state.fork_requested(message.rref, message.fork, src)
            self.lanes[(dst, src, REPLY)].append(Confirmed(message.rref))
            return []
        if isinstance(message, Confirmed):
            return state.fork_confirmed(message.rref)
        if isinstance(message, ChildAccepted):
            return state.child_accepted(message.rref, message.fork)
        return state.fork_deleted(message.rref, message.fork)

    def _receive_handle(self, dst: int, carrier: Carrier) -> list[Instruction]:
        try:
            out = self.states[dst].receive(
                carrier.rref, carrier.owner, carrier.fork, carrier.parent
            )
        except KeyError:  # freed on its owner: allowed only once a pin died with its worker
            assert carrier.rref in self.exposed, f"{carrier} reached its owner after a Free"
            return []
        self.handles[dst][carrier.rref] += 1
        return out

    # -- events ------------------------------------------------------------------------

    def create_local(self, w: int) -> None:
        rref = self.states[w].create_local()
        self.owner_of[rref] = w
        self.handles[w][rref] += 1

    def remote(self, src: int, dst: int) -> None:
        rref, fork = self.states[src].create_remote(dst)
        self.owner_of[rref] = dst
        self.uncreated.add(rref)
        self.handles[src][rref] += 1
        self.lanes[(src, dst, REQUEST)].append(Create(rref, fork))

    def send(self, w: int, rref: RRefId, to: int, in_request: bool) -> None:
        """A handle is pickled into a request or a reply to ``to``."""
        fork = self.states[w].send(rref, to, in_request)
        if to not in self.alive:  # the dial fails: the shell undoes the pickling
            self._carry_out(w, self.states[w].unsend(rref, fork))
            return
        carrier = Carrier(rref, self.owner_of[rref], fork, w)
        self.lanes[(w, to, REQUEST if in_request else REPLY)].append(carrier)

    def send_fails(self, w: int, rref: RRefId, to: int, in_request: bool) -> None:
        """A handle is pickled into a message that never leaves: the send is undone."""
        before = snapshot(self.states[w])
        fork = self.states[w].send(rref, to, in_request)
        assert self.states[w].unsend(rref, fork) == []  # the handle still exists
        assert snapshot(self.states[w]) == before

    def deliver(self, lane: Lane, twice: bool = False) -> None:
        """The head of ``lane`` arrives (and, if ``twice``, arrives again)."""
        src, dst, _ = lane
        message = self.lanes[lane].popleft()
        self._carry_out(dst, self._receive(src, dst, message))
        if twice and isinstance(message, IDEMPOTENT):
            before = snapshot(*self.states)
            assert self._receive(src, dst, message) == []
            assert snapshot(*self.states) == before

    def answer_create(self, index: int) -> None:
        """The owner has made a remote() value and replies to its creator."""
        owner, creator, rref = self.making.pop(index)
        self.lanes[(owner, creator, REPLY)].append(Confirmed(rref))

    def drop(self, w: int, rref: RRefId) -> None:
        self.handles[w][rref] -= 1
        self._carry_out(w, self.states[w].handle_dropped(rref))

    def can_kill(self) -> bool:
        """At most one death, once some fork or message is at stake."""
        at_stake = any(s.held for s in self.states) or any(self.lanes.values())
        return len(self.alive) == len(RANKS) and at_stake

    def kill(self, k: int) -> None:
        """A worker dies: its messages and Python handles vanish, the others lose it."""
        self.alive.discard(k)
        self.handles[k].clear()
        self.exposed |= {r for r, owner in self.owner_of.items() if owner == k}
        self.exposed |= {rref for rref, _ in self.states[k].children.values()}
        self._drop_lanes_of(k)
        for s in sorted(self.alive):
            self._carry_out(s, self.states[s].peer_lost(k))
            before = snapshot(self.states[s])  # every link to it reports the loss
            assert not any(isinstance(i, (Send, Free)) for i in self.states[s].peer_lost(k))
            assert snapshot(self.states[s]) == before

    def _drop_lanes_of(self, k: int) -> None:
        failed: list[tuple[int, RRefId]] = []  # (requester, rref): calls to k that fail
        for (src, dst, kind), queue in self.lanes.items():
            if src == k and kind == REPLY:
                failed += [(dst, m.rref) for m in queue if isinstance(m, Confirmed)]
            elif dst == k:
                failed += [(src, m.rref) for m in queue if isinstance(m, (ForkRequest, Create))]
            if k in (src, dst):
                queue.clear()
        failed += [(creator, rref) for owner, creator, rref in self.making if owner == k]
        self.making = [m for m in self.making if k not in m[:2]]
        for requester, rref in failed:
            if requester != k:
                self.lanes[(k, requester, REPLY)].append(Confirmed(rref))

    # -- checks ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self._check_referenced_kept()
        self._check_handle_counts()
        self._check_confirmed_forks_counted()
        self._check_pins()

    def _check_referenced_kept(self) -> None:
        for rref in self.referenced():
            owner = self.owner_of[rref]
            if owner in self.alive and rref not in self.exposed | self.uncreated:
                assert rref in self.states[owner].owned, f"{rref} is referenced but gone"

    def _check_handle_counts(self) -> None:
        for w, rref in self.holdings():
            n, owner = self.handles[w][rref], self.owner_of[rref]
            if owner == w and rref in self.states[w].gone:
                assert rref in self.exposed, f"{rref} is gone though no holder died"
                continue  # a dead holder's child came back after the free: a dead handle
            entry = self.states[w].owned[rref] if owner == w else self.states[w].held[rref]
            assert entry.handles == n, f"worker {w} counts {entry.handles} handles of {rref}"

    def _check_confirmed_forks_counted(self) -> None:
        for w in self.alive:
            for rref, held in self.states[w].held.items():
                if held.confirmed and held.owner in self.alive and rref not in self.exposed:
                    assert self.states[held.owner].owned[rref].forks.get(held.fork) == w

    def _check_pins(self) -> None:
        for w in self.alive:
            state = self.states[w]
            pins = Counter(rref for rref, _ in state.children.values())
            assert pins == Counter({r: h.children for r, h in state.held.items() if h.children})

    def flush(self) -> None:
        """Deliver everything, answering every create."""
        while self.making or self.deliverable():
            while self.making:
                self.answer_create(0)
            for lane in self.deliverable():
                self.deliver(lane)

    def finish(self, graceful: bool) -> None:
        """Deliver everything; shut down gracefully or drop every handle; nothing leaks."""
        self.flush()
        if graceful:
            self._shut_down()
        for w, rref in self.holdings(live_owner=False):
            while self.handles[w][rref]:
                self.drop(w, rref)
        self.flush()
        for w in self.alive:
            state = self.states[w]
            pinned = [rref for rref, _ in state.children.values()]
            left = {*state.owned, *state.held, *pinned}
            assert not left, f"worker {w} leaks {state.owned} {state.held} {state.children}"

    def _unsettled(self, state: RRefState) -> set[RRefId]:
        """What keeps ``state`` from being settled (so drain waits)."""
        pinned = {rref for rref, _ in state.children.values()}
        return pinned | {rref for rref, held in state.held.items() if not held.confirmed}

    def _shut_down(self) -> None:
        """Graceful shutdown: once settled, every worker gives up every fork it holds."""
        for w in self.alive:
            unsettled = self._unsettled(self.states[w])
            assert self.states[w].settled == (not unsettled)
            assert not unsettled, f"worker {w} is never settled: {unsettled}"
        self.shut = True
        for w in sorted(self.alive):
            self._carry_out(w, self.states[w].release_all())
        self.flush()
        for w in self.alive:
            state = self.states[w]
            assert not state.held and not state.children
            for rref, owned in state.owned.items():
                assert not owned.forks and owned.handles == self.handles[w][rref]


# -- the hypothesis model ----------------------------------------------------------------

MAX_RREFS = 3  # live RRefs at once: few, so that handles travel far


class RRefProtocolModel(RuleBasedStateMachine):
    """Random runs of :class:`Cluster`: user actions, deliveries and one death."""

    def __init__(self) -> None:
        super().__init__()
        self.world = Cluster()
        self.graceful = False

    def _new_rref_allowed(self) -> bool:
        return len(self.world.referenced()) < MAX_RREFS

    def _draw_handle(self, data: st.DataObject, live_owner: bool = True) -> tuple[int, RRefId]:
        return data.draw(st.sampled_from(self.world.holdings(live_owner)), label="handle")

    def _draw_lane(self, data: st.DataObject, kind: str) -> Lane:
        return data.draw(st.sampled_from(self.world.deliverable(kind)), label="lane")

    @initialize(graceful=st.booleans())
    def choose_teardown(self, graceful: bool) -> None:
        """How the run ends: graceful shutdown (release_all) or every handle dropped."""
        self.graceful = graceful

    @precondition(_new_rref_allowed)
    @rule(data=st.data())
    def create_local(self, data: st.DataObject) -> None:
        self.world.create_local(data.draw(st.sampled_from(sorted(self.world.alive))))

    @precondition(lambda self: len(self.world.alive) > 1 and self._new_rref_allowed())
    @rule(data=st.data())
    def remote(self, data: st.DataObject) -> None:
        src, dst = data.draw(st.permutations(sorted(self.world.alive)), label="src, dst")[:2]
        self.world.remote(src, dst)

    # Two rules, not one with a flag, so that handles travel twice as often.
    @precondition(lambda self: bool(self.world.holdings()))
    @rule(data=st.data(), to=st.sampled_from(RANKS))
    def send_in_request(self, data: st.DataObject, to: int) -> None:
        self.world.send(*self._draw_handle(data), to, in_request=True)

    @precondition(lambda self: bool(self.world.holdings()))
    @rule(data=st.data(), to=st.sampled_from(RANKS))
    def send_in_reply(self, data: st.DataObject, to: int) -> None:
        self.world.send(*self._draw_handle(data), to, in_request=False)

    @precondition(lambda self: bool(self.world.holdings()))
    @rule(data=st.data(), to=st.sampled_from(RANKS), in_request=st.booleans())
    def send_fails(self, data: st.DataObject, to: int, in_request: bool) -> None:
        self.world.send_fails(*self._draw_handle(data), to, in_request)

    @precondition(lambda self: bool(self.world.deliverable(REQUEST)))
    @rule(data=st.data(), twice=st.booleans())
    def deliver_request(self, data: st.DataObject, twice: bool) -> None:
        self.world.deliver(self._draw_lane(data, REQUEST), twice)

    @precondition(lambda self: bool(self.world.deliverable(REPLY)))
    @rule(data=st.data(), twice=st.booleans())
    def deliver_reply(self, data: st.DataObject, twice: bool) -> None:
        self.world.deliver(self._draw_lane(data, REPLY), twice)

    @precondition(lambda self: bool(self.world.making))
    @rule(data=st.data())
    def answer_create(self, data: st.DataObject) -> None:
        self.world.answer_create(data.draw(st.integers(0, len(self.world.making) - 1)))

    @precondition(lambda self: bool(self.world.holdings(live_owner=False)))
    @rule(data=st.data())
    def drop_handle(self, data: st.DataObject) -> None:
        self.world.drop(*self._draw_handle(data, live_owner=False))

    @precondition(lambda self: self.world.can_kill())
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        pinning = [w for w in RANKS if self.world.states[w].children]  # the riskier deaths
        self.world.kill(data.draw(st.sampled_from(pinning * 3 + list(RANKS)), label="killed"))

    @invariant()
    def invariants_hold(self) -> None:
        self.world.check_invariants()

    def teardown(self) -> None:
        self.world.finish(self.graceful)


MODEL_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_model() -> None:
    run_state_machine_as_test(RRefProtocolModel, settings=MODEL_SETTINGS)


# -- exhaustive search of small scenarios ---------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """What the user may still do in a small scenario (deliveries and drops are free)."""

    sends: int
    kill: bool


def successors(world: Cluster, scope: Scope) -> list[tuple[str, tuple[Any, ...], Scope]]:
    """Every (event, arguments, scope left) possible from ``world``."""
    out: list[tuple[str, tuple[Any, ...], Scope]] = []
    out += [("deliver", (lane,), scope) for lane in world.deliverable()]
    out += [("answer_create", (i,), scope) for i in range(len(world.making))]
    out += [("drop", held, scope) for held in world.holdings(live_owner=False)]
    if scope.sends:
        fewer = Scope(scope.sends - 1, scope.kill)
        for w, rref in world.holdings():
            for to in RANKS:
                out += [("send", (w, rref, to, flag), fewer) for flag in (True, False)]
    if scope.kill and world.can_kill():
        out += [("kill", (k,), Scope(scope.sends, False)) for k in sorted(world.alive)]
    return out


def explore(start: Callable[[Cluster], None], scope: Scope) -> int:
    """Check every state reachable from ``start`` within ``scope``; how many there were.

    In each: the invariants, and that both ways to finish from it leak nothing.
    """
    world = Cluster()
    start(world)
    seen = {world.key()}
    todo = [(world, scope)]
    while todo:
        world, scope = todo.pop()
        for event, args, left in successors(world, scope):
            after = world.clone()
            getattr(after, event)(*args)
            key = after.key()
            if key in seen:
                continue
            seen.add(key)
            after.check_invariants()
            after.clone().finish(graceful=False)
            after.clone().finish(graceful=True)
            todo.append((after, left))
    return len(seen)


STARTS: dict[str, Callable[[Cluster], None]] = {
    "local": lambda world: world.create_local(A),  # owned by A
    "remote": lambda world: world.remote(A, B),  # made by A, owned by B
}
SCOPES = [  # (start, scope, about half the states there are now): a few seconds in all
    pytest.param("local", Scope(sends=2, kill=False), 200, id="local-2-sends"),
    pytest.param("remote", Scope(sends=2, kill=False), 3000, id="remote-2-sends"),
    pytest.param("local", Scope(sends=2, kill=True), 600, id="local-2-sends-1-death"),
    pytest.param("remote", Scope(sends=1, kill=True), 300, id="remote-1-send-1-death"),
]


@pytest.mark.parametrize(("start", "scope", "states"), SCOPES)
def test_every_interleaving(start: str, scope: Scope, states: int) -> None:
    """All orders of a few sends (and a death), deliveries, answers and drops."""
    assert explore(STARTS[start], scope) >= states  # the search did cover its scope
