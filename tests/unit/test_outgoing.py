"""Unit tests for the outgoing side's bookkeeping, without sockets or an agent: an
``Outgoing`` message's two endings, the reducers' undo it owns, and the notice queue
that takes back what an abandoned message carried."""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrpc.agent.notices import Notices
from asyncrpc.agent.outgoing import Outgoing
from asyncrpc.agent.transfer import (
    PLAIN,
    TENSORS,
    Transfer,
    current_transfer,
    dumps_reply,
    dumps_request,
    loads_reply,
)
from asyncrpc.errors import LocalProtocolError, PeerLostError
from asyncrpc.wire import Kind

AGENT = object()  # the agent a transfer carries: opaque to these modules
log: list[str] = []  # what the reducers below did and undid, in order


class Registers:
    """Pickles like a value whose reducer changes state (an RRef registering a fork)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Any:
        transfer = current_transfer()
        assert transfer is not None and transfer.agent is AGENT and transfer.peer_rank == 3
        log.append(f"+{self.name}")
        transfer.undo.append(lambda: log.append(f"-{self.name}"))
        return Registers, (self.name,)


def _transfer_seen() -> Transfer | None:
    return current_transfer()


class AsksForTransfer:
    """Unpickles as the transfer it was unpickled in (as an RRef's handle reads it)."""

    def __reduce__(self) -> Any:
        return _transfer_seen, ()


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle this on purpose")


class FakeLink:
    """The part of a Link an Outgoing uses; ``refuse`` makes it raise as a Link does."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.closed = False
        self.refuse = refuse
        self.sent: list[tuple[int, dict[str, Any]]] = []

    def send(self, kind: int, meta: dict[str, Any], *_: Any, function: str) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.sent.append((kind, meta))

    def encode(self, kind: int, meta: dict[str, Any], *_: Any, function: str) -> list[bytes]:
        if self.refuse is not None:
            raise self.refuse
        return [b"frame"]


@pytest.fixture(autouse=True)
def clear_log() -> None:
    log.clear()


def request(notices: Notices | None = None, *carried: str) -> Outgoing:
    """A request for worker 3 whose value registers "a" then "b"; it carries ``carried``
    (notices taken from ``notices`` for peer "p")."""
    message = dumps_request(AGENT, 3, [Registers("a"), Registers("b")], call_id=7, function="f")
    if notices is not None:
        for value in carried:
            notices.add("p", ["k", value])
        message.carry(notices.take("p"), functools.partial(notices.give_back, "p"))
    return message


def test_a_request_and_a_reply_carry_their_call_in_the_header() -> None:
    message = request()
    assert (message.kind, message.meta, message.call_id) == (Kind.REQUEST, {"i": 7, "f": "f"}, 7)
    reply = dumps_reply(AGENT, 3, torch.ones(2), call_id=7, function="f")
    entries = [("t", "float32", (2,), (1,))]  # a plain tensor's (serde.lean)
    meta = {"i": 7, PLAIN: True, TENSORS: entries}
    assert (reply.kind, reply.meta, reply.function) == (Kind.RESPONSE, meta, "f")
    assert torch.equal(
        loads_reply(AGENT, 3, reply.payload, reply.buffers, plain=True, tensors=entries),
        torch.ones(2),
    )
    assert reply.size == len(reply.payload) + 8


def test_a_value_no_reducer_has_a_part_in_is_marked_plain_here_too() -> None:
    """Senders write small plain values themselves (``dumps_plain``, marked PLAIN); one
    given here, or a larger one, is pickled without reducers (serde.lean) and marked
    PLAIN all the same; one a reducer had a part in is not."""
    reply = dumps_reply(AGENT, 3, {"loss": 0.5, "step": 3}, call_id=7, function="f")
    assert reply.meta == {"i": 7, PLAIN: True}
    log.clear()
    assert PLAIN not in dumps_reply(AGENT, 3, [Registers("x")], call_id=8, function="f").meta
    assert log == ["+x"]  # (its reducer ran once, in the message's transfer)
    assert loads_reply(AGENT, 3, reply.payload, reply.buffers, plain=True) == {
        "loss": 0.5,
        "step": 3,
    }


def test_a_message_marked_plain_is_unpickled_without_a_transfer() -> None:
    reply = dumps_reply(AGENT, 3, AsksForTransfer(), call_id=7, function="f")
    seen = loads_reply(AGENT, 3, reply.payload, reply.buffers, plain=False)
    assert isinstance(seen, Transfer) and (seen.agent, seen.peer_rank) == (AGENT, 3)
    # A sender that marked it plain would have it rebuilt without one (an RRef's handle
    # then raises that it can only be unpickled from a message).
    assert loads_reply(AGENT, 3, reply.payload, reply.buffers, plain=True) is None


def test_abandon_undoes_latest_first_and_only_once() -> None:
    message = request()
    assert log == ["+a", "+b"]
    message.abandon()
    assert log == ["+a", "+b", "-b", "-a"]
    message.abandon()
    message.sent()
    assert log == ["+a", "+b", "-b", "-a"]


def test_a_sent_message_keeps_its_effects() -> None:
    message = request()
    message.sent()
    message.abandon()  # too late: the first ending decided
    assert log == ["+a", "+b"]


def test_a_failed_serialisation_undoes_at_once() -> None:
    with pytest.raises(Exception, match="on purpose"):
        dumps_request(AGENT, 3, [Registers("a"), Unpicklable()], call_id=1, function="f")
    assert log == ["+a", "-a"]


def test_an_abandoned_message_gives_its_notices_back_to_go_first() -> None:
    notices = Notices()
    message = request(notices, "old")
    assert message.meta["n"] == [["k", "old"]] and len(notices) == 0
    notices.add("p", ["k", "new"])
    message.abandon()
    assert len(notices) == 2
    assert notices.take("p") == [["k", "old"], ["k", "new"]]


def test_a_sent_message_gives_nothing_back() -> None:
    notices = Notices()
    message = request(notices, "gone")
    message.sent()
    message.abandon()
    assert len(notices) == 0 and notices.told == {"p"}


def test_send_on_a_link_that_takes_it_sends_it() -> None:
    link = FakeLink()
    message = request()
    message.send_on(link)  # type: ignore[arg-type]
    assert link.sent == [(Kind.REQUEST, {"i": 7, "f": "f"})]
    message.abandon()
    assert log == ["+a", "+b"]


@pytest.mark.parametrize("refusal", ["too large", "lost"])
def test_send_on_a_link_that_refuses_it_abandons_it_and_raises(refusal: str) -> None:
    notices = Notices()
    link = FakeLink(LocalProtocolError("too large") if refusal == "too large" else None)
    link.closed = refusal == "lost"
    message = request(notices, "n")
    with pytest.raises(LocalProtocolError if refusal == "too large" else PeerLostError):
        message.send_on(link)  # type: ignore[arg-type]
    assert link.sent == []
    assert log == ["+a", "+b", "-b", "-a"]
    assert notices.take_returned("p") == [["k", "n"]]


def test_encode_for_abandons_what_the_link_refuses() -> None:
    assert request().encode_for(FakeLink()) == [b"frame"]  # type: ignore[arg-type]
    assert log == ["+a", "+b"]
    with pytest.raises(LocalProtocolError):
        request().encode_for(FakeLink(LocalProtocolError("too large")))  # type: ignore[arg-type]
    assert log == ["+a", "+b", "+a", "+b", "-b", "-a"]


def test_notices_given_back_come_before_queued_ones_and_alone_on_request() -> None:
    notices = Notices()
    notices.add("p", ["k", 2])
    notices.give_back("p", [["k", 0], ["k", 1]])
    notices.add("q", ["k", "q"])
    assert len(notices) == 4
    assert notices.take_returned("p") == [["k", 0], ["k", 1]]
    assert notices.take_returned("p") == []
    notices.give_back("p", [["k", 1]])
    notices.give_back("p", [["k", 0]])  # given back later, but taken earlier
    assert notices.take_all() == {"p": [["k", 0], ["k", 1], ["k", 2]], "q": [["k", "q"]]}
    assert notices.told == {"p", "q"} and len(notices) == 0


def test_a_peer_that_cannot_be_reached_is_forgotten() -> None:
    notices = Notices()
    notices.add("p", ["k", 1])
    notices.give_back("p", [["k", 0]])
    notices.add("q", ["k", "q"])
    notices.forget("p")
    assert notices.take("p") == [] and notices.told == set()
    assert notices.take("q") == [["k", "q"]]


def test_the_agent_first_notice_schedules_a_flush() -> None:
    notices = Notices()
    notices.give_back("p", [["k", 0]])  # waits for the next message: no flush of its own
    assert notices.add("q", ["k", 1]) is True
    assert notices.add("p", ["k", 2]) is False


@pytest.mark.parametrize("module", ["notices", "outgoing", "transfer"])
def test_the_agents_helpers_do_not_import_the_agent(module: str) -> None:
    """Not even for type checking: they depend on what they are given, not on RpcAgent."""
    source = Path(__file__).parents[2] / "asyncrpc" / "agent" / f"{module}.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not {name for name in imported if name.startswith("asyncrpc.agent.agent")}
    assert "asyncrpc.agent" not in imported  # the package's root imports the agent
