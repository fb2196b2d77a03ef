"""Unit tests for the admission of inbound connections: at most ``limit`` handshaking at
once, refused ones closed unread, and one warning per ``WARN_EVERY`` seconds that says
how many were refused since the last one.  The clock is the test's."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest

from asyncrpc.transport.admission import WARN_EVERY, Admission, Refused
from asyncrpc.transport.link import Link


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Links:
    """Stands in for the listener's Link factory; counts the Links it made."""

    def __init__(self) -> None:
        self.made: list[Link] = []

    def __call__(self) -> Link:
        self.made.append(cast(Link, object()))
        return self.made[-1]


class FakeTransport:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append(name)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncrpc.transport"]


def test_admits_up_to_the_limit_and_refuses_beyond_it() -> None:
    clock = Clock()
    gate, links = Admission(limit=3, clock=clock), Links()
    admitted = [gate.admit(links) for _ in range(3)]
    assert admitted == links.made and gate.pending == 3 and gate.refused == 0
    refused = gate.admit(links)
    assert isinstance(refused, Refused)
    assert len(links.made) == 3  # no Link is built for a refused connection
    assert (gate.pending, gate.refused) == (3, 1)


def test_a_settled_link_frees_its_slot_once() -> None:
    clock = Clock()
    gate, links = Admission(limit=2, clock=clock), Links()
    first, second = gate.admit(links), gate.admit(links)
    gate.settled(cast(Link, first))
    gate.settled(cast(Link, first))  # established, then lost: counted out once
    assert gate.pending == 1
    assert gate.admit(links) is links.made[-1]
    assert isinstance(gate.admit(links), Refused)
    gate.settled(cast(Link, second))
    assert gate.pending == 1


def test_settling_a_link_never_admitted_changes_nothing() -> None:
    """Outgoing links settle too, and they were never counted."""
    clock = Clock()
    gate, links = Admission(limit=1, clock=clock), Links()
    gate.admit(links)
    gate.settled(Links()())
    assert gate.pending == 1 and isinstance(gate.admit(links), Refused)


def test_a_limit_of_zero_refuses_every_connection() -> None:
    clock = Clock()
    gate, links = Admission(limit=0, clock=clock), Links()
    assert all(isinstance(gate.admit(links), Refused) for _ in range(5))
    assert links.made == [] and gate.refused == 5


def test_a_refused_connection_is_aborted_as_soon_as_it_is_made() -> None:
    transport = FakeTransport()
    Refused().connection_made(transport)  # type: ignore[arg-type]
    assert transport.calls == ["abort"]  # not read, not a graceful close


def test_refusals_warn_once_per_period_with_the_count_since_the_last_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncrpc.transport")
    clock = Clock()
    gate, links = Admission(limit=2, clock=clock), Links()
    for _ in range(2):
        gate.admit(links)

    gate.admit(links)
    assert warnings_of(caplog) == [
        "refusing inbound connections: 2 are still authenticating "
        "(max_pending_handshakes); 1 refused since the last warning"
    ]
    for _ in range(4):  # within the period: counted, not logged
        clock.now += WARN_EVERY / 5
        gate.admit(links)
    assert len(warnings_of(caplog)) == 1

    clock.now += WARN_EVERY / 5  # exactly one period after the first warning
    gate.admit(links)
    assert warnings_of(caplog)[1:] == [
        "refusing inbound connections: 2 are still authenticating "
        "(max_pending_handshakes); 5 refused since the last warning"
    ]
    assert gate.refused == 6


def test_the_next_warning_counts_from_the_last_one_not_from_the_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncrpc.transport")
    clock = Clock()
    gate, links = Admission(limit=0, clock=clock), Links()
    gate.admit(links)
    clock.now += WARN_EVERY - 0.001
    gate.admit(links)  # just inside the period
    clock.now += 0.001
    gate.admit(links)
    clock.now += WARN_EVERY
    gate.admit(links)
    counts = [message.rsplit("; ", 1)[1] for message in warnings_of(caplog)]
    assert counts == [
        "1 refused since the last warning",
        "2 refused since the last warning",
        "1 refused since the last warning",
    ]


def test_a_new_admission_warns_at_its_first_refusal_even_at_time_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The monotonic clock may start near zero (a fresh boot)."""
    caplog.set_level(logging.WARNING, logger="asyncrpc.transport")
    clock = Clock()
    clock.now = 0.0
    Admission(limit=0, clock=clock).admit(Links())
    assert len(warnings_of(caplog)) == 1
