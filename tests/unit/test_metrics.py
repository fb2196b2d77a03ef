"""CallMetrics, histograms and their quantiles, and how a failed call's outcome is named."""

from __future__ import annotations

import pytest

from asyncrpc import AgentStateError, PeerLostError, RPCTimeoutError
from asyncrpc.agent.metrics import (
    BUCKETS,
    MAX_SERIES,
    OTHER,
    CallMetrics,
    Histogram,
    outcome_of,
    quantile,
)


def test_a_histogram_counts_each_observation_in_the_first_bucket_that_holds_it() -> None:
    h = Histogram()
    for seconds in (BUCKETS[0], BUCKETS[0] * 1.01, 1e9):
        h.observe(seconds)
    assert h.counts[0] == 1 and h.counts[1] == 1 and h.counts[-1] == 1
    assert h.count == 3
    assert h.total == pytest.approx(BUCKETS[0] * 2.01 + 1e9)


def test_quantiles_interpolate_inside_their_bucket() -> None:
    h = Histogram()
    for _ in range(100):
        h.observe(0.003)  # the (2.5 ms, 5 ms] bucket
    snap = h.snapshot()
    assert quantile(snap, 0.5) == pytest.approx(0.0025 + 0.0025 * 0.5)
    assert quantile(snap, 1.0) == pytest.approx(0.005)
    assert quantile(Histogram().snapshot(), 0.5) is None
    h.observe(1e9)
    assert quantile(h.snapshot(), 1.0) == BUCKETS[-1]


def test_calls_are_counted_per_function_and_outcome() -> None:
    m = CallMetrics()
    m.made("f", "ok", 0.001)
    m.made("f", "ok", 0.002)
    m.made("f", "timeout", 5.0)
    m.served("g", "error", 0.01, queued=0.004)
    snap = m.snapshot()
    assert snap["made"]["f"]["outcomes"] == {"ok": 2, "timeout": 1}
    assert sum(snap["made"]["f"]["seconds"]["counts"]) == 3
    assert snap["served"]["g"]["outcomes"] == {"error": 1}
    assert snap["served"]["g"]["queued_seconds"]["sum"] == pytest.approx(0.004)
    assert snap["buckets"] == list(BUCKETS)


def test_outcomes_are_named_by_what_the_call_failed_with() -> None:
    assert outcome_of(None) == "ok"
    assert outcome_of(RPCTimeoutError("late")) == "timeout"
    assert outcome_of(PeerLostError("gone")) == "lost"
    assert outcome_of(AgentStateError("shut down")) == "lost"
    assert outcome_of(ValueError("bad")) == "error"
    remote_timeout = RPCTimeoutError("a nested call timed out")
    remote_timeout.remote_worker = "w1"  # type: ignore[attr-defined]
    assert outcome_of(remote_timeout) == "error"  # raised by the remote function


def test_function_series_are_bounded_the_rest_count_together() -> None:
    m = CallMetrics()
    for i in range(MAX_SERIES + 50):
        m.made(f"f{i}", "ok", 0.001)
        m.served(f"g{i}", "ok", 0.001, queued=0.0)
    snap = m.snapshot()
    for side in ("made", "served"):
        assert len(snap[side]) == MAX_SERIES + 1, side
        assert sum(snap[side][OTHER]["outcomes"].values()) == 50, side
    m.made("f0", "error", 0.1)  # a function counted apart stays apart
    assert m.snapshot()["made"]["f0"]["outcomes"] == {"ok": 1, "error": 1}
