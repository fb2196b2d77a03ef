"""Unit tests of the agent's lifecycle and its sans-IO shutdown barrier
(asyncrpc.agent.shutdown).

The barrier is events in, actions out, so these tests drive it by hand: first the
transition table and short stories, then every interleaving of small scenarios
(``itertools.permutations``) and random longer ones (hypothesis), each checked
step by step against :class:`World`, a reference model written from the spec
rather than from the code: a phase passes exactly when every peer was reached and
announced it or is dead; a link is never told a phase twice; a live peer with no
open link that heard the current phase is told again on the next link it shows
up on; giving up names exactly the peers missing.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrpc.agent.shutdown import (
    PHASES,
    Action,
    GaveUp,
    Lifecycle,
    Passed,
    Reach,
    ShutdownBarrier,
    Stage,
    Tell,
)

Barrier = ShutdownBarrier[str]  # links are named by strings here

# -- the lifecycle -----------------------------------------------------------------------


def test_lifecycle_values_are_the_strings_the_debug_info_shows() -> None:
    assert [s.value for s in Lifecycle] == [
        "new",
        "listening",
        "running",
        "draining",
        "closing",
        "closed",
    ]
    assert Lifecycle.CLOSED == "closed"  # code that compares with the strings still works
    assert f"{Lifecycle.DRAINING}" == "draining"


def test_lifecycle_usable_only_while_running_or_draining() -> None:
    assert {s for s in Lifecycle if s.usable} == {Lifecycle.RUNNING, Lifecycle.DRAINING}
    assert {s for s in Lifecycle if s.ending} == {Lifecycle.CLOSING, Lifecycle.CLOSED}


# -- the transition table ----------------------------------------------------------------


def in_stage(stage: Stage, phase: int = 1) -> Barrier:
    """A barrier with peers b and c, in ``stage`` at ``phase``, b on link "lb"."""
    barrier = Barrier(["b", "c"])
    if stage is Stage.IDLE:
        return barrier
    for p in range(1, phase + 1):
        barrier.start(p)
        barrier.reached("b", "lb")
        barrier.reached("c", "lc")
        if p < phase or stage is Stage.PASSED:
            barrier.peer_announced("b", p, "lb")
            assert barrier.peer_announced("c", p, "lc") == [Passed(p)]
    if stage is Stage.GAVE_UP:
        barrier.give_up()
    assert (barrier.stage, barrier.phase) == (stage, phase)
    return barrier


@dataclass(frozen=True)
class Row:
    stage: Stage
    phase: int
    event: str
    args: tuple[Any, ...]
    actions: list[Action[str]]
    then: Stage


IDLE, WAITING, PASSED, GAVE_UP = Stage.IDLE, Stage.WAITING, Stage.PASSED, Stage.GAVE_UP
TABLE = [
    # Nothing started: record, tell nobody.
    Row(IDLE, 0, "start", (1,), [Reach("b"), Reach("c")], WAITING),
    Row(IDLE, 0, "peer_announced", ("b", 1, "lb"), [], IDLE),
    Row(IDLE, 0, "connected", ("b", "lb2"), [], IDLE),
    Row(IDLE, 0, "peer_lost", ("b",), [], IDLE),
    Row(IDLE, 0, "reached", ("b", "lb"), [], IDLE),  # no Reach out: stale
    Row(IDLE, 0, "dial_failed", ("b", True), [], IDLE),
    # Waiting at phase 1 (b and c reached, told on lb and lc).
    Row(WAITING, 1, "peer_announced", ("b", 1, "lb"), [], WAITING),
    Row(WAITING, 1, "peer_announced", ("b", 2, "lb"), [], WAITING),  # not phase 1's
    Row(WAITING, 1, "peer_lost", ("b",), [], WAITING),
    Row(WAITING, 1, "connected", ("b", "lb2"), [], WAITING),  # lb heard us already
    Row(WAITING, 1, "start", (1,), [], WAITING),  # started already
    Row(WAITING, 1, "reached", ("b", "lb"), [], WAITING),  # no Reach out: stale
    # Phase 1 passed.
    Row(PASSED, 1, "start", (2,), [Reach("b"), Reach("c")], WAITING),
    Row(PASSED, 1, "peer_announced", ("b", 2, "lb"), [], PASSED),
    Row(PASSED, 1, "peer_lost", ("c",), [], PASSED),
    Row(PASSED, 1, "connected", ("c", "lc2"), [], PASSED),
    # Waiting at phase 2.
    Row(WAITING, 2, "peer_announced", ("b", 2, "lb"), [], WAITING),
    Row(WAITING, 2, "start", (2,), [], WAITING),
    Row(PASSED, 2, "peer_announced", ("b", 1, "lb3"), [], PASSED),
    # Gave up: nothing more, ever.
    Row(GAVE_UP, 1, "start", (2,), [], GAVE_UP),
    Row(GAVE_UP, 1, "peer_announced", ("b", 1, "lb2"), [], GAVE_UP),
    Row(GAVE_UP, 1, "connected", ("b", "lb2"), [], GAVE_UP),
    Row(GAVE_UP, 1, "peer_lost", ("b",), [], GAVE_UP),
    Row(GAVE_UP, 1, "reached", ("b", "lb"), [], GAVE_UP),
    Row(GAVE_UP, 1, "dial_failed", ("b", True), [], GAVE_UP),
]


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r.stage.name}{r.phase}-{r.event}")
def test_transition_table(row: Row) -> None:
    barrier = in_stage(row.stage, row.phase)
    assert getattr(barrier, row.event)(*row.args) == row.actions
    assert barrier.stage is row.then


@pytest.mark.parametrize(
    ("stage", "phase", "start"),
    [(IDLE, 0, 2), (WAITING, 1, 2), (IDLE, 0, 3), (PASSED, 1, 3)],
)
def test_starting_a_phase_out_of_order_raises(stage: Stage, phase: int, start: int) -> None:
    barrier = in_stage(stage, phase)
    with pytest.raises(ValueError, match=f"phase {start}"):
        barrier.start(start)


def test_every_reach_outcome_at_waiting() -> None:
    barrier = Barrier(["b", "c", "d"])
    assert barrier.start(1) == [Reach("b"), Reach("c"), Reach("d")]
    assert barrier.dial_failed("b", busy=True) == [Reach("b")]  # alive but busy: again
    assert barrier.dial_failed("c", busy=False) == []  # refused: dead
    assert barrier.dead == {"c"} and barrier.reaching == {"b", "d"}
    assert barrier.reached("d", "ld") == [Tell("ld", (1,))]
    assert barrier.reached("b", "lb") == [Tell("lb", (1,))]
    assert barrier.peer_announced("d", 1, "ld") == []
    assert barrier.peer_announced("b", 1, "lb") == [Passed(1)]


# -- stories -----------------------------------------------------------------------------


def test_no_peers_passes_each_phase_at_once() -> None:
    barrier = Barrier([])
    assert barrier.start(1) == [Passed(1)]
    assert barrier.start(2) == [Passed(2)]


def test_passes_only_once_every_peer_is_reached_even_if_all_announced() -> None:
    barrier = Barrier(["b"])
    barrier.peer_announced("b", 1, "in")  # b was quicker than us
    assert barrier.start(1) == [Reach("b")]  # b must still hear from us
    assert barrier.reached("b", "in") == [Tell("in", (1,)), Passed(1)]


def test_a_link_is_told_each_phase_once() -> None:
    barrier = Barrier(["b"])
    barrier.start(1)
    assert barrier.reached("b", "l") == [Tell("l", (1,))]
    assert barrier.peer_announced("b", 1, "l") == [Passed(1)]
    barrier.start(2)
    assert barrier.reached("b", "l") == [Tell("l", (2,))]  # not phase 1 again
    assert barrier.connected("b", "l2") == []  # l heard phase 2: nothing to repeat
    assert barrier.peer_announced("b", 2, "l2") == [Passed(2)]


def test_a_new_link_is_told_every_phase() -> None:
    barrier = Barrier(["b"])
    barrier.start(1)
    barrier.reached("b", "l1")
    barrier.peer_announced("b", 1, "l1")
    barrier.start(2)
    assert barrier.reached("b", "l2") == [Tell("l2", (1, 2))]  # e.g. we dialled it since


def test_a_peer_that_reconnects_after_we_announced_is_told_again() -> None:
    """Our SHUTDOWN went out on a link that then closed: it may never have arrived.
    The peer is lost (dead for the barrier), yet it dials us again: tell it."""
    barrier = Barrier(["b", "c"])
    barrier.start(1)
    barrier.reached("b", "l1")
    barrier.link_closed("l1")
    assert barrier.peer_lost("b") == []  # c is still missing
    assert barrier.dead == {"b"}
    assert barrier.connected("b", "l2") == [Tell("l2", (1,))]
    assert barrier.dead == {"b"}  # a connection alone does not make us wait for it
    assert barrier.connected("b", "l3") == []  # l2 is open and heard us
    barrier.reached("c", "lc")
    assert barrier.peer_announced("c", 1, "lc") == [Passed(1)]


def test_a_peer_given_up_for_dead_that_announces_is_told_and_alive_again() -> None:
    barrier = Barrier(["b"])
    barrier.start(1)
    assert barrier.dial_failed("b", busy=False) == [Passed(1)]  # dead: nothing to wait for
    barrier.start(2)
    assert barrier.dial_failed("b", busy=False) == [Passed(2)]
    assert barrier.dead == {"b"}
    assert barrier.peer_announced("b", 1, "in") == [Tell("in", (1, 2))]
    assert barrier.dead == set()


def test_a_peer_lost_before_shutdown_is_alive_again_once_connected() -> None:
    """A partition healed before anyone shut down: the peer is not dead any more."""
    barrier = Barrier(["b"])
    barrier.peer_lost("b")
    assert barrier.dead == {"b"}
    assert barrier.connected("b", "l2") == []
    assert barrier.dead == set()


def test_a_reached_peer_is_alive_again() -> None:
    barrier = Barrier(["b"])
    barrier.peer_lost("b")  # one link dropped before shutdown
    assert barrier.dead == {"b"}
    barrier.start(1)
    assert barrier.reached("b", "l") == [Tell("l", (1,))]
    assert barrier.dead == set()  # so we wait for it
    assert barrier.peer_announced("b", 1, "l") == [Passed(1)]


def test_a_peer_lost_while_being_dialled_is_waited_for_until_the_dial_ends() -> None:
    barrier = Barrier(["b"])
    barrier.start(1)
    assert barrier.peer_lost("b") == []  # our Reach is still out
    assert barrier.dial_failed("b", busy=False) == [Passed(1)]


def test_a_finished_peer_is_not_dead() -> None:
    barrier = Barrier(["b"])
    barrier.start(1)
    barrier.reached("b", "l")
    barrier.peer_announced("b", 1, "l")
    barrier.start(2)
    barrier.reached("b", "l")
    assert barrier.peer_announced("b", 2, "l") == [Passed(2)]
    barrier.link_closed("l")
    barrier.peer_lost("b")
    assert barrier.dead == set()


@pytest.mark.parametrize("phase", [0, 3, "1", None, [1], 1.5])
def test_announcing_anything_but_a_phase_changes_nothing(phase: Any) -> None:
    barrier = Barrier(["b"])
    barrier.peer_lost("b")
    barrier.start(1)
    before = copy.deepcopy(vars(barrier))
    assert barrier.peer_announced("b", phase, "l") == []
    assert vars(barrier) == before


def test_unknown_workers_change_nothing() -> None:
    barrier = Barrier(["b"])
    barrier.start(1)
    before = copy.deepcopy(vars(barrier))
    for event in (
        barrier.peer_announced("x", 1, "l"),
        barrier.connected("x", "l"),
        barrier.peer_lost("x"),
        barrier.reached("x", "l"),
        barrier.dial_failed("x", busy=False),
    ):
        assert event == []
    assert vars(barrier) == before


def test_give_up_names_the_peers_missing_from_the_first_phase_short_of_them() -> None:
    barrier = Barrier(["b", "c", "d"])
    barrier.peer_announced("c", 1, "lc")
    barrier.peer_lost("d")
    assert barrier.give_up() == GaveUp(1, ("b",))
    assert barrier.stage is Stage.GAVE_UP

    barrier = Barrier(["b", "c"])
    for peer in ("b", "c"):
        barrier.peer_announced(peer, 1, f"l{peer}")
    barrier.peer_announced("c", 2, "lc")
    assert barrier.give_up() == GaveUp(2, ("b",))

    assert Barrier(["b"]).give_up() == GaveUp(1, ("b",))
    assert Barrier([]).give_up() == GaveUp(2, ())


# -- every interleaving, against a reference model ---------------------------------------

# A token is one event of the agent's world: ("start", phase), ("connect", peer, link),
# ("close", peer, link, lost), ("announce", peer, phase, link), ("reach", peer, link),
# ("busy", peer), ("refused", peer).
Token = tuple[Any, ...]


@dataclass
class World:
    """The barrier, what the agent would know, and the spec it must meet."""

    peers: tuple[str, ...]
    barrier: Barrier = field(init=False)
    phase: int = 0
    passed: list[int] = field(default_factory=list)
    reaching: set[str] = field(default_factory=set)  # Reach actions not answered yet
    links: dict[str, str] = field(default_factory=dict)  # open link -> its peer
    told: dict[str, set[int]] = field(default_factory=dict)  # open link -> phases told
    seen: set[str] = field(default_factory=set)  # every link ever opened
    announced: dict[int, set[str]] = field(default_factory=lambda: {1: set(), 2: set()})
    dead: set[str] = field(default_factory=set)
    steps: int = 0
    passed_at: list[int] = field(default_factory=list)  # the step each phase passed at

    def __post_init__(self) -> None:
        self.barrier = Barrier(self.peers)

    def valid(self, token: Token) -> bool:
        """Whether ``token`` can happen now (the agent never starts phase 2 before phase
        1 passed, answers only a Reach that is out, hears only on open links)."""
        what, *args = token
        if what == "start":
            return args[0] == self.phase + 1 and (self.phase in self.passed or args[0] == 1)
        if what == "connect":
            return args[1] not in self.seen
        if what == "close":
            return self.links.get(args[1]) == args[0]
        if what == "announce":
            return self.links.get(args[2]) == args[0]
        if what == "reach":
            return args[0] in self.reaching and self.links.get(args[1]) == args[0]
        return args[0] in self.reaching  # busy, refused

    def apply(self, token: Token) -> None:
        what, *args = token
        expected_tell = self._expected_tell(token)
        barrier = self.barrier
        if what == "start":
            actions = barrier.start(args[0])
        elif what == "connect":
            self.links[args[1]] = args[0]
            self.told[args[1]] = set()
            self.seen.add(args[1])
            actions = barrier.connected(args[0], args[1])
        elif what == "close":
            del self.links[args[1]], self.told[args[1]]
            barrier.link_closed(args[1])
            actions = barrier.peer_lost(args[0]) if args[2] else []
        elif what == "announce":
            actions = barrier.peer_announced(*args)
        elif what == "reach":
            actions = barrier.reached(*args)
        else:
            actions = barrier.dial_failed(args[0], busy=what == "busy")
        self._update_model(token)
        self._check(token, actions, expected_tell)

    # -- the spec ------------------------------------------------------------------------

    def _expected_tell(self, token: Token) -> str | None:
        """The link this event must tell our phases on, if any."""
        what, *args = token
        if self.phase == 0 or what not in ("reach", "connect", "announce"):
            return None
        link = args[-1]
        if what == "reach":  # the link a Reach found must hear every phase
            return link if self.phase not in self.told[link] else None
        peer = args[0]
        heard = any(self.phase in self.told[k] for k, p in self.links.items() if p == peer)
        return None if heard or peer in self.reaching else link

    def _update_model(self, token: Token) -> None:
        what, *args = token
        if what == "start":
            self.phase = args[0]
            self.reaching = set(self.peers)
        elif what == "announce":
            self.announced[args[1]].add(args[0])
            self.dead.discard(args[0])
        elif what == "reach":
            self.reaching.discard(args[0])
            self.dead.discard(args[0])
        elif what == "connect" and self.phase == 0:  # before shutdown: a link revives
            self.dead.discard(args[0])
        elif what == "refused" or (what == "close" and args[2]):
            if what == "refused":
                self.reaching.discard(args[0])  # a peer lost meanwhile waits for the dial
            if args[0] not in self.announced[2]:  # finished, not dead
                self.dead.add(args[0])

    def _check(self, token: Token, actions: list[Action[str]], expected_tell: str | None) -> None:
        context = (token, actions)
        reaches = [a.peer for a in actions if isinstance(a, Reach)]
        tells = [a for a in actions if isinstance(a, Tell)]
        passed = [a.phase for a in actions if isinstance(a, Passed)]
        if token[0] == "start":
            assert reaches == sorted(self.peers), context
        elif token[0] == "busy":
            assert reaches == [token[1]], context  # dialled again
        else:
            assert reaches == [], context
        self.reaching |= set(reaches)
        assert [t.link for t in tells] == ([expected_tell] if expected_tell else []), context
        for tell in tells:  # every phase the link lacks, each once, in order
            assert tell.phases == tuple(
                p for p in PHASES[: self.phase] if p not in self.told[tell.link]
            )
            self.told[tell.link] |= set(tell.phases)
        complete = (
            self.phase > 0
            and not self.reaching
            and all(p in self.announced[self.phase] or p in self.dead for p in self.peers)
        )
        assert passed == ([self.phase] if complete and self.phase not in self.passed else [])
        self.passed += passed
        self.steps += 1
        self.passed_at += [self.steps] * len(passed)
        assert self.barrier.dead == self.dead, context
        assert self.barrier.reaching == self.reaching, context

    def check_give_up(self) -> None:
        """Giving up (on a copy) names what the model says is missing, then ignores all."""
        barrier = copy.deepcopy(self.barrier)
        missing = {p: sorted(set(self.peers) - self.announced[p] - self.dead) for p in PHASES}
        first = next((p for p in PHASES if missing[p]), 2)
        assert barrier.give_up() == GaveUp(first, tuple(missing[first]))
        assert barrier.start(self.phase + 1) == []
        for peer in self.peers:
            assert barrier.connected(peer, "fresh") == []
            assert barrier.peer_announced(peer, 1, "fresh") == []


def run(peers: Iterable[str], setup: list[Token], tokens: Iterable[Token]) -> World | None:
    """Apply ``setup`` then ``tokens``; None if some token could not happen when it came."""
    world = World(tuple(peers))
    for token in [*setup, *tokens]:
        if not world.valid(token):
            return None
        world.apply(token)
    world.check_give_up()
    return world


SCENARIOS: dict[str, tuple[tuple[str, ...], list[Token], list[Token]]] = {
    "one-reached-one-refused-then-shows-up": (
        ("b", "c"),
        [("connect", "b", "lb")],
        [
            ("start", 1),
            ("reach", "b", "lb"),
            ("announce", "b", 1, "lb"),
            ("refused", "c"),
            ("connect", "c", "lc"),
            ("announce", "c", 1, "lc"),
            ("close", "c", "lc", True),
        ],
    ),
    "busy-then-reached-while-another-announces-and-is-lost": (
        ("b", "c"),
        [("connect", "c", "lc")],
        [
            ("start", 1),
            ("busy", "b"),
            ("connect", "b", "lb"),
            ("reach", "b", "lb"),
            ("announce", "b", 1, "lb"),
            ("reach", "c", "lc"),
            ("announce", "c", 1, "lc"),
            ("close", "c", "lc", True),
        ],
    ),
    "told-link-lost-then-reconnects": (
        ("b", "c"),
        [("connect", "b", "l1")],
        [
            ("start", 1),
            ("reach", "b", "l1"),
            ("close", "b", "l1", True),
            ("connect", "b", "l2"),
            ("announce", "b", 1, "l2"),
            ("refused", "c"),
            ("connect", "c", "lc"),
        ],
    ),
    "both-phases-over-two-links": (
        ("b",),
        [("connect", "b", "l1")],
        [
            ("start", 1),
            ("connect", "b", "l2"),
            ("reach", "b", "l1"),
            ("announce", "b", 1, "l2"),
            ("start", 2),
            ("reach", "b", "l2"),
            ("announce", "b", 2, "l1"),
            ("close", "b", "l1", False),
        ],
    ),
    "three-peers": (
        ("b", "c", "d"),
        [("connect", "b", "lb"), ("connect", "c", "lc"), ("connect", "d", "ld")],
        [
            ("start", 1),
            ("reach", "b", "lb"),
            ("announce", "b", 1, "lb"),
            ("refused", "c"),
            ("announce", "c", 1, "lc"),
            ("reach", "d", "ld"),
            ("close", "d", "ld", True),
        ],
    ),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_interleaving(name: str) -> None:
    peers, setup, tokens = SCENARIOS[name]
    worlds = [run(peers, setup, order) for order in set(itertools.permutations(tokens))]
    done = [w for w in worlds if w is not None]
    assert len(done) >= 20, len(done)  # enough of the orders can happen
    # The orders move the moment the barrier passes (checked at each step above).
    assert len({tuple(w.passed_at) for w in done}) > 1


PEERS = ("b", "c", "d")
ALPHABET: list[Token] = [
    *(("start", phase) for phase in PHASES),
    *(("connect", p, f"{p}{i}") for p in PEERS for i in range(3)),
    *(("close", p, f"{p}{i}", lost) for p in PEERS for i in range(3) for lost in (False, True)),
    *(("announce", p, phase, f"{p}{i}") for p in PEERS for phase in PHASES for i in range(3)),
    *(("reach", p, f"{p}{i}") for p in PEERS for i in range(3)),
    *((what, p) for what in ("busy", "refused") for p in PEERS),
]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_histories(data: st.DataObject) -> None:
    """Up to 60 events, each drawn from those that can happen at that point."""
    world = World(PEERS)
    for _ in range(60):
        possible = [token for token in ALPHABET if world.valid(token)]
        if not possible:
            break
        world.apply(data.draw(st.sampled_from(possible)))
    world.check_give_up()
