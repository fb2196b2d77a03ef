"""BatchQueue with a fake clock: when a batch is due, what it holds, what is refused."""

from __future__ import annotations

import pytest

from asyncrpc import OverloadedError
from asyncrpc.serving import BatchQueue


def queue(max_size: int = 3, max_wait: float = 1.0, max_queue: int = 5) -> BatchQueue[str]:
    return BatchQueue("tests.infer", max_size=max_size, max_wait=max_wait, max_queue=max_queue)


def test_nothing_is_due_while_nothing_waits() -> None:
    assert queue().due_in(now=0.0) is None


def test_the_oldest_item_sets_the_clock() -> None:
    q = queue()
    q.put("a", now=10.0)
    q.put("b", now=10.6)
    assert q.due_in(now=10.25) == pytest.approx(0.75)
    assert q.due_in(now=11.0) == 0.0
    assert q.due_in(now=12.0) == 0.0  # overdue is due, never negative


def test_a_full_batch_is_due_at_once_and_takes_at_most_max_size_oldest_first() -> None:
    q = queue(max_size=3)
    tickets = [q.put(item, now=0.0) for item in "abcd"]
    assert q.due_in(now=0.0) == 0.0
    assert q.take() == list(zip(tickets[:3], "abc", strict=True))
    assert len(q) == 1
    assert q.due_in(now=0.5) == pytest.approx(0.5)  # "d" waits for its own time
    assert q.take() == [(tickets[3], "d")]
    assert q.due_in(now=0.5) is None


def test_dropping_the_oldest_item_hands_the_clock_to_the_next() -> None:
    q = queue()
    first = q.put("a", now=0.0)
    q.put("b", now=0.4)
    assert q.drop(first) is True
    assert q.due_in(now=0.5) == pytest.approx(0.9)
    assert [item for _, item in q.take()] == ["b"]


def test_a_dropped_item_is_never_taken_and_drops_once() -> None:
    q = queue()
    kept, dropped = q.put("a", now=0.0), q.put("b", now=0.0)
    assert q.drop(dropped) is True
    assert q.drop(dropped) is False
    assert q.take() == [(kept, "a")]
    assert q.drop(kept) is False  # taken: no longer waiting


def test_a_full_queue_refuses_at_once_naming_the_function_and_its_bound() -> None:
    q = queue(max_queue=2)
    q.put("a", now=0.0)
    q.put("b", now=0.0)
    with pytest.raises(OverloadedError, match=r"tests\.infer.*2 calls already wait") as info:
        q.put("c", now=0.0)
    assert info.value.details == {"function": "tests.infer", "max_queue": 2}
    assert isinstance(info.value, RuntimeError)
    q.take()
    q.put("c", now=0.0)  # room again once a batch left


def test_max_wait_zero_makes_every_item_due_at_once() -> None:
    q = queue(max_wait=0.0)
    q.put("a", now=5.0)
    assert q.due_in(now=5.0) == 0.0


@pytest.mark.parametrize(
    "limits",
    [
        {"max_size": 0, "max_wait": 0.1, "max_queue": 1},
        {"max_size": 1, "max_wait": -1.0, "max_queue": 1},
        {"max_size": 1, "max_wait": float("nan"), "max_queue": 1},
        {"max_size": 1, "max_wait": 0.1, "max_queue": 0},
    ],
)
def test_limits_that_make_no_sense_are_refused(limits: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"batch tests\.f: max_size and max_queue"):
        BatchQueue("tests.f", **limits)  # type: ignore[arg-type]
