"""What a worker counts about its calls: cheap enough to stay on in every job.

Theory of operation
-------------------
Every call a worker makes ends in :meth:`CallMetrics.made` with its function, its
outcome and the seconds from ``rpc_async`` to its end; every call it serves ends
in :meth:`CallMetrics.served` with the seconds from the request's arrival to the
reply, and how many of those it waited before it started.  Each is a dict
increment and a histogram observation (a bisect over fixed buckets), a few
hundred nanoseconds on the loop, so the counters are always on.

Outcomes: ``ok``; ``error`` (the function raised; for the caller, the remote
function did); ``timeout`` (the deadline passed); ``lost`` (the peer or the
connection was lost, or the agent closed); ``cancelled`` (served: the caller
gave up; made: the caller cancelled the call's future).  Histograms have fixed
upper bounds (``BUCKETS``, seconds, as Prometheus wants them: cumulative at
export, plus ``+Inf``).

Nothing here reads the clock or knows the agent: callers pass the seconds.  A
:meth:`snapshot` is plain data (JSON-able) for ``get_debug_info()``, the
Prometheus exposition and the dashboard, which live a layer up
(:mod:`asyncrpc.observability`).
"""

from __future__ import annotations

import asyncio
import os
from bisect import bisect_left
from typing import Any

from asyncrpc.errors import AgentStateError, PeerLostError, RPCTimeoutError

BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Histogram upper bounds in seconds (a last bucket, +Inf, holds the rest)."""

OUTCOMES = ("ok", "error", "timeout", "lost", "cancelled")
MAX_SERIES = 256
"""Functions counted apart, per direction; calls of any further ones count together
under ``OTHER``, so that a job whose call names vary cannot grow memory without end."""
OTHER = "(other functions)"


def outcome_of(error: BaseException | None) -> str:
    """How a call this worker made ended, by what it failed with (None: it did not).
    An exception raised by the remote function is an ``error`` whatever its type."""
    if error is None:
        return "ok"
    if getattr(error, "remote_worker", None) is not None:
        return "error"
    if isinstance(error, RPCTimeoutError):
        return "timeout"
    if isinstance(error, PeerLostError | AgentStateError):
        return "lost"
    if isinstance(error, asyncio.CancelledError):  # the caller cancelled it
        return "cancelled"
    return "error"


class Histogram:
    """Counts of observations per bucket, and their sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.total}


def quantile(snapshot: dict[str, Any], q: float) -> float | None:
    """An estimate of quantile ``q`` (0..1) of a histogram snapshot, interpolating
    linearly inside the bucket it falls in (as Prometheus' histogram_quantile does);
    None when it holds nothing.  Above the last bound it answers that bound."""
    counts: list[int] = snapshot["counts"]
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            if index == len(BUCKETS):
                return BUCKETS[-1]
            lower = BUCKETS[index - 1] if index else 0.0
            return lower + (BUCKETS[index] - lower) * (rank - seen) / count
        seen += count
    return BUCKETS[-1]


_OUTCOME_INDEX = {outcome: index for index, outcome in enumerate(OUTCOMES)}


class FunctionCalls:
    """One function's calls on one side: per outcome, and their latency histograms."""

    __slots__ = ("outcomes", "queued", "seconds")

    def __init__(self, *, queued: bool) -> None:
        self.outcomes = [0] * len(OUTCOMES)
        self.seconds = Histogram()
        self.queued = Histogram() if queued else None

    def snapshot(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "outcomes": {o: n for o, n in zip(OUTCOMES, self.outcomes, strict=True) if n},
            "seconds": self.seconds.snapshot(),
        }
        if self.queued is not None:
            entry["queued_seconds"] = self.queued.snapshot()
        return entry


class CallMetrics:
    """Calls made and served by one worker, per function and outcome, with latencies.

    (Per call: one dict lookup per side and a few list increments, no allocation but
    the numbers', so that counting stays well under the cost of a call.)"""

    def __init__(self) -> None:
        self._made: dict[str, FunctionCalls] = {}
        self._served: dict[str, FunctionCalls] = {}

    def made(self, function: str, outcome: str, seconds: float) -> None:
        """A call this worker made ended."""
        calls = self._made.get(function)
        if calls is None:
            calls = _series(self._made, function, queued=False)
        calls.outcomes[_OUTCOME_INDEX[outcome]] += 1
        calls.seconds.observe(seconds)

    def served(self, function: str, outcome: str, seconds: float, queued: float) -> None:
        """A call this worker served ended: ``seconds`` from arrival to reply, of which
        ``queued`` before it started."""
        calls = self._served.get(function)
        if calls is None:
            calls = _series(self._served, function, queued=True)
        calls.outcomes[_OUTCOME_INDEX[outcome]] += 1
        calls.seconds.observe(seconds)
        calls.queued.observe(queued)  # type: ignore[union-attr]  # served: always kept

    def snapshot(self) -> dict[str, Any]:
        """Plain data: ``{"made": {function: {"outcomes": {...}, "seconds": {...}}},
        "served": {function: {"outcomes", "seconds", "queued_seconds"}}, "buckets"}``."""
        return {
            "buckets": list(BUCKETS),
            "made": {f: calls.snapshot() for f, calls in list(self._made.items())},
            "served": {f: calls.snapshot() for f, calls in list(self._served.items())},
        }


def _series(series: dict[str, FunctionCalls], function: str, *, queued: bool) -> FunctionCalls:
    """The counters of a function not counted yet: its own, or, beyond ``MAX_SERIES``
    functions, the ones they all share."""
    if len(series) >= MAX_SERIES:
        function = OTHER
        if function in series:
            return series[function]
    calls = series[function] = FunctionCalls(queued=queued)
    return calls


class NullMetrics(CallMetrics):
    """Counts nothing: what a worker keeps with ``ASYNCRPC_METRICS=0`` (to measure what
    the counting costs; see benchmarks/bench_metrics.py)."""

    def made(self, function: str, outcome: str, seconds: float) -> None:
        pass

    def served(self, function: str, outcome: str, seconds: float, queued: float) -> None:
        pass


def call_metrics() -> CallMetrics:
    """Counters for a new agent: on, unless ``ASYNCRPC_METRICS=0``."""
    return NullMetrics() if os.environ.get("ASYNCRPC_METRICS", "1") == "0" else CallMetrics()
