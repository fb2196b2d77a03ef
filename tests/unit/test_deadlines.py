"""Deadlines on one loop timer: what expires, when, and what the heap keeps.

A fake loop stands in for the event loop: its clock moves only when a test moves it,
and its timers fire only when the test says so, so every deadline is exact.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import Any, cast

import pytest

from asyncrpc.agent.deadlines import COMPACT_ABOVE, DUE_WITHIN, Deadlines


class Timer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    def __init__(self) -> None:
        self.now = 1000.0
        self.timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when, callback)
        self.timers.append(timer)
        return timer

    @property
    def armed(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]

    def advance_to(self, when: float) -> None:
        """Move the clock, then fire the one armed timer if its time has come."""
        self.now = when
        (timer,) = self.armed
        if timer.when <= when:
            timer.cancelled = True  # a fired handle is spent
            timer.callback()


def make() -> tuple[Deadlines, FakeLoop, dict[int, str], list[int]]:
    loop = FakeLoop()
    live: dict[int, str] = {}
    expired: list[int] = []

    def expire(key: int) -> None:
        expired.append(key)
        del live[key]  # as the agent's _expire finishes the call

    return Deadlines(cast(Any, loop), expire, live), loop, live, expired


def start(deadlines: Deadlines, live: dict[int, str], key: int, timeout: float) -> None:
    live[key] = "pending"
    deadlines.add(key, timeout)


def test_a_live_key_expires_at_its_deadline_and_an_ended_one_never() -> None:
    deadlines, loop, live, expired = make()
    start(deadlines, live, 1, 5.0)
    start(deadlines, live, 2, 5.0)
    del live[1]  # the first call ended
    loop.advance_to(1004.0)
    assert expired == []
    loop.advance_to(1005.0)
    assert expired == [2]
    assert loop.armed == []  # nothing left to wait for


def test_calls_with_one_timeout_share_one_timer() -> None:
    deadlines, loop, live, _ = make()
    for key in range(100):
        loop.now += 0.001
        start(deadlines, live, key, 60.0)
    assert len(loop.timers) == 1  # armed once, at the first deadline


def test_an_earlier_deadline_rearms_the_timer() -> None:
    deadlines, loop, live, expired = make()
    start(deadlines, live, 1, 60.0)
    start(deadlines, live, 2, 1.0)
    (timer,) = loop.armed
    assert timer.when == 1001.0
    loop.advance_to(1001.0)
    assert expired == [2]
    assert [t.when for t in loop.armed] == [1060.0]  # armed again for the one left
    loop.advance_to(1060.0)
    assert expired == [2, 1]


def test_due_keys_expire_in_deadline_order_and_the_next_live_one_arms_the_timer() -> None:
    deadlines, loop, live, expired = make()
    for key, timeout in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 10.0), (5, 20.0)):
        start(deadlines, live, key, timeout)
    del live[4]  # ended: its deadline must not arm the timer
    loop.advance_to(1005.0)
    assert expired == [2, 3, 1]
    assert [t.when for t in loop.armed] == [1020.0]
    assert len(deadlines) == 1  # the ended key's entry went on the way


def test_a_timer_that_fires_a_little_early_still_expires_what_is_due() -> None:
    deadlines, loop, live, expired = make()
    start(deadlines, live, 1, 2.0)
    loop.now = 1002.0 - DUE_WITHIN / 2
    (timer,) = loop.armed
    timer.callback()
    assert expired == [1]


def test_ended_entries_do_not_pile_up() -> None:
    """At 50,000 calls a second and a 60 s timeout the heap would hold millions."""
    deadlines, loop, live, expired = make()
    kept = list(range(0, 20 * COMPACT_ABOVE, 97))  # a few calls stay pending throughout
    for key in range(20 * COMPACT_ABOVE):
        start(deadlines, live, key, 60.0)
        if key % 97:
            del live[key]  # most end at once
        assert len(deadlines) <= max(COMPACT_ABOVE, 4 * len(live)) + 1
    loop.advance_to(1060.0)
    assert expired == kept  # the live ones survived every rebuild, in order


def test_many_live_keys_rebuild_rarely(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild is linear in the heap, so with every entry live (thousands of calls in
    flight) it must come once per doubling, not on every add."""
    rebuilds: list[int] = []
    real_heapify = heapq.heapify
    monkeypatch.setattr(
        heapq, "heapify", lambda heap: (rebuilds.append(len(heap)), real_heapify(heap))
    )
    deadlines, loop, live, expired = make()
    for key in range(8 * COMPACT_ABOVE):
        start(deadlines, live, key, 60.0 + key * 1e-6)
    assert len(deadlines) == 8 * COMPACT_ABOVE  # nothing dropped
    assert rebuilds == [COMPACT_ABOVE + 1, 2 * COMPACT_ABOVE + 3, 4 * COMPACT_ABOVE + 7]
    loop.advance_to(1061.0)
    assert expired == list(range(8 * COMPACT_ABOVE))


def test_a_failing_expiry_is_logged_and_the_others_still_expire(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = FakeLoop()
    live = {1: "a", 2: "b"}
    expired: list[int] = []

    def expire(key: int) -> None:
        del live[key]
        if key == 1:
            raise RuntimeError("the link refused the CANCEL")
        expired.append(key)

    deadlines = Deadlines(cast(Any, loop), expire, live)
    deadlines.add(1, 1.0)
    deadlines.add(2, 1.0)
    with caplog.at_level(logging.ERROR, logger="asyncrpc.agent"):
        loop.advance_to(1001.0)
    assert expired == [2]
    assert "expiring call 1 failed" in caplog.text


def test_close_forgets_every_deadline() -> None:
    deadlines, loop, live, expired = make()
    start(deadlines, live, 1, 1.0)
    deadlines.close()
    assert loop.armed == []
    assert len(deadlines) == 0
    assert expired == []
