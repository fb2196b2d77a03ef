"""When a batch is formed: the waiting room of a batched function, with no clock of its own.

Theory of operation
-------------------
:class:`BatchQueue` holds the items waiting for a batch, oldest first, each
under a ticket, and the time it arrived (the caller passes ``now``: tests pass
a fake clock, the shell passes the loop's).  It answers three questions:

* :meth:`put` -- may this item wait?  Not when ``max_queue`` items already
  wait: it raises :class:`~asyncrpc.errors.OverloadedError` at once, so a
  caller learns of the overload instead of waiting behind it.
* :meth:`due_in` -- how long until a batch is due: 0 once ``max_size`` items
  wait or the oldest has waited ``max_wait``; None while nothing waits.
* :meth:`take` -- the next batch, oldest first, at most ``max_size`` items.

:meth:`drop` takes out an item whose caller gave up (cancelled, timed out)
before its batch started; the oldest *remaining* item then sets the clock.
How many batches run at once is the shell's business, not the queue's.
"""

from __future__ import annotations

import itertools
from typing import Generic, TypeVar

from asyncrpc.errors import OverloadedError

T = TypeVar("T")


def check_limits(name: str, *, max_size: int, max_wait: float, max_queue: int) -> None:
    """Raise ValueError, naming the function, unless the limits make sense."""
    if max_size < 1 or max_queue < 1 or not max_wait >= 0:
        raise ValueError(
            f"batch {name}: max_size and max_queue must be >= 1 and max_wait >= 0 "
            f"(got max_size={max_size}, max_wait={max_wait}, max_queue={max_queue})"
        )


class BatchQueue(Generic[T]):
    """Items waiting to be batched (see the module docstring)."""

    def __init__(self, name: str, *, max_size: int, max_wait: float, max_queue: int) -> None:
        check_limits(name, max_size=max_size, max_wait=max_wait, max_queue=max_queue)
        self.name = name
        self.max_size = max_size
        self.max_wait = max_wait
        self.max_queue = max_queue
        self._waiting: dict[int, tuple[float, T]] = {}  # ticket -> (arrived, item), oldest first
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, item: T, now: float) -> int:
        """Queue ``item``; its ticket.  Raises OverloadedError when the queue is full."""
        if len(self._waiting) >= self.max_queue:
            raise OverloadedError(
                f"batched function {self.name} is overloaded: {self.max_queue} calls "
                "already wait (max_queue); call again later or add replicas",
                function=self.name,
                max_queue=self.max_queue,
            )
        ticket = next(self._tickets)
        self._waiting[ticket] = (now, item)
        return ticket

    def drop(self, ticket: int) -> bool:
        """Take out a waiting item (its caller gave up); whether it was still waiting."""
        return self._waiting.pop(ticket, None) is not None

    def due_in(self, now: float) -> float | None:
        """Seconds until a batch is due (0: now), or None while nothing waits."""
        if not self._waiting:
            return None
        if len(self._waiting) >= self.max_size:
            return 0.0
        oldest = next(iter(self._waiting.values()))[0]
        return max(0.0, oldest + self.max_wait - now)

    def take(self) -> list[tuple[int, T]]:
        """The next batch: up to ``max_size`` waiting items, oldest first, as (ticket, item)."""
        batch = list(itertools.islice(self._waiting.items(), self.max_size))
        for ticket, _ in batch:
            del self._waiting[ticket]
        return [(ticket, item) for ticket, (_, item) in batch]
