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
gave up).  Histograms have fixed upper bounds (``BUCKETS``, seconds, as
Prometheus wants them: cumulative at export, plus ``+Inf``).

Nothing here reads the clock or knows the agent: callers pass the seconds.  A
:meth:`snapshot` is plain data (JSON-able) for ``get_debug_info()``, the
Prometheus exposition and the dashboard, which live a layer up
(:mod:`asyncrpc.observability`).
"""

from __future__ import annotations

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


class CallMetrics:
    """Calls made and served by one worker, per function and outcome, with latencies."""

    def __init__(self) -> None:
        self.made_calls: dict[tuple[str, str], int] = {}  # (function, outcome) -> calls
        self.served_calls: dict[tuple[str, str], int] = {}
        self.made_seconds: dict[str, Histogram] = {}  # function -> caller-side latency
        self.served_seconds: dict[str, Histogram] = {}  # arrival to reply, queueing included
        self.queued_seconds: dict[str, Histogram] = {}  # arrival to start

    def made(self, function: str, outcome: str, seconds: float) -> None:
        """A call this worker made ended."""
        key = (function, outcome)
        self.made_calls[key] = self.made_calls.get(key, 0) + 1
        _histogram(self.made_seconds, function).observe(seconds)

    def served(self, function: str, outcome: str, seconds: float, queued: float) -> None:
        """A call this worker served ended: ``seconds`` from arrival to reply, of which
        ``queued`` before it started."""
        key = (function, outcome)
        self.served_calls[key] = self.served_calls.get(key, 0) + 1
        _histogram(self.served_seconds, function).observe(seconds)
        _histogram(self.queued_seconds, function).observe(queued)

    def snapshot(self) -> dict[str, Any]:
        """Plain data: ``{"made": {function: {"outcomes": {...}, "seconds": {...}}},
        "served": {function: {"outcomes", "seconds", "queued_seconds"}}, "buckets"}``."""
        made = _per_function(self.made_calls, {"seconds": self.made_seconds})
        served = _per_function(
            self.served_calls,
            {"seconds": self.served_seconds, "queued_seconds": self.queued_seconds},
        )
        return {"buckets": list(BUCKETS), "made": made, "served": served}


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


def _histogram(table: dict[str, Histogram], function: str) -> Histogram:
    found = table.get(function)
    if found is None:
        found = table[function] = Histogram()
    return found


def _per_function(
    calls: dict[tuple[str, str], int], histograms: dict[str, dict[str, Histogram]]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for (function, outcome), count in list(calls.items()):
        entry = out.setdefault(function, {"outcomes": {}})
        entry["outcomes"][outcome] = count
    for name, table in histograms.items():
        for function, histogram in list(table.items()):
            out.setdefault(function, {"outcomes": {}})[name] = histogram.snapshot()
    return out
