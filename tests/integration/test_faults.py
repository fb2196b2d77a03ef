"""Fault injection on real worker processes: what survivors see, and that they survive.

A peer SIGKILLed or SIGSTOPped in the middle of tensor calls (inline and
shared-memory sizes), a worker leaving under load, a caller whose event loop is
blocked while its server shuts down, remote code raising KeyboardInterrupt or
SystemExit.  The workers are in ``tests/fault_scenarios.py``.  Every call a
scenario issues must end exactly once (returned or raised), and every worker
that is not killed on purpose must exit 0.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.cluster import run_job
from tests.fault_scenarios import LEAVE_AFTER, WINDOW

pytestmark = pytest.mark.timeout(120)
SIGKILLED = -signal.SIGKILL


def assert_every_call_ended(tally: dict[str, Any]) -> None:
    assert tally["unfinished"] == 0, tally
    assert tally["issued"] == tally["completed"] + tally["failures"], tally
    assert tally["wrong_values"] == 0, tally


def test_sigkilled_peer_fails_tensor_calls_and_the_survivor_keeps_calling_it() -> None:
    workers = run_job(
        "fault_scenarios.killed_during_tensor_calls", timeout=90, expect_exit={1: SIGKILLED}
    )
    seen = workers[0].result  # run_job checked: the survivor exited 0 (no SIGSEGV)
    echoed, held = seen["echoed"], seen["held"]
    for tally in (echoed, held):
        assert_every_call_ended(tally)
        assert set(tally["failed"]) <= {"PeerLostError"}, tally
        assert tally["not_naming_peer"] == [], tally
    assert echoed["completed"] >= 300
    assert held["failed"] == {"PeerLostError": 10}  # held for 60 s: in flight at the kill
    assert seen["in_flight_at_kill"] >= 10
    assert seen["settled_after_kill_s"] < 10  # at once, not at the calls' 60 s timeout
    afterwards = seen["afterwards"]
    assert afterwards["failed"] == {"PeerLostError": afterwards["calls"]}, afterwards
    assert afterwards["not_naming_peer"] == []
    last = afterwards["last_error"]
    assert last["connection"] and "'w1'" in last["message"], last
    assert afterwards["gc_collections"] > 10
    assert seen["pending_after"] == 0


def test_sigstopped_peer_times_calls_out_and_serves_again_after_sigcont() -> None:
    seen = run_job("fault_scenarios.stopped_during_tensor_calls", timeout=90)[0].result
    assert seen["warm"] == [0.0, 1.0, 2.0, 3.0]
    during, stopped = seen["during"], seen["stopped"]
    for tally in (during, stopped):  # in flight at the stop: answered already, or timed out
        assert_every_call_ended(tally)
        assert set(tally["failed"]) <= {"RPCTimeoutError"}, tally
        assert tally["not_naming_peer"] == [], tally
    assert stopped["failed"] == {"RPCTimeoutError": 20}, stopped  # issued while stopped
    assert 1.4 < seen["timed_out_after_s"] < 15  # by their own 1.5 s timeout
    resumed = seen["resumed"]
    assert_every_call_ended(resumed)
    assert resumed["completed"] == 20, resumed
    assert seen["debug"]["dead_peers"] == []
    assert seen["debug"]["pending_outgoing_calls"] == 0


def test_worker_leaving_under_load_loses_no_call_of_the_others() -> None:
    workers = run_job("fault_scenarios.leaving_under_load", world=3, timeout=90)
    leaver = workers[2].result
    assert min(leaver["served"].values()) >= 75, leaver  # from each caller, then it left
    assert leaver["own_calls"] == ["AgentStateError"] * 2  # its calls end when it leaves
    for worker in workers[:2]:
        seen = worker.result
        assert seen["leaver_gone"], seen
        with_peer, with_leaver = seen["with_peer"], seen["with_leaver"]
        assert_every_call_ended(with_peer)
        assert_every_call_ended(with_leaver)
        assert with_peer["failures"] == 0, with_peer
        assert seen["peer_calls_after_gone"] >= 300
        # It served LEAVE_AFTER calls of each caller; a non-graceful leave may drop the
        # answers it had not sent yet, at most the calls in flight to it (half the window).
        served_here = leaver["served"][f"w{worker.rank}"]
        assert with_leaver["completed"] <= served_here, (with_leaver, leaver)
        assert with_leaver["completed"] >= LEAVE_AFTER - WINDOW // 2, with_leaver
        assert with_leaver["failures"] > 0, with_leaver
        assert set(with_leaver["failed"]) == {"PeerLostError"}, with_leaver
        assert with_leaver["not_naming_peer"] == [], with_leaver
        assert seen["shutdown_s"] < 20


def test_busy_workers_keep_their_calls_while_a_server_shuts_down() -> None:
    """Loops blocked (5 s) past the handshake timeout (2 s) while w1 shuts down: w0 with
    calls in flight to w1, w2 with no link to it yet.  w1 must wait for both, not give
    them up for dead: every call of w0's succeeds, and w2's calls afterwards too."""
    caller, server, bystander = run_job(
        "fault_scenarios.busy_workers_during_shutdown", world=3, timeout=90
    )
    for worker, calls in ((caller, 31), (bystander, 10)):
        seen = worker.result
        assert seen["blocked_s"] > 4.9
        assert_every_call_ended(seen["calls"])
        assert seen["calls"]["failed"] == {}, (worker.rank, seen["calls"])
        assert seen["calls"]["completed"] == calls
    assert server.result["shutdown_s"] > 0


@pytest.mark.parametrize(
    ("where", "calls"),
    [
        pytest.param("thread", ("rpc", "remote"), id="plain-function"),
        pytest.param("loop", ("rpc", "remote", "async_execution"), id="async-def"),
    ],
)
def test_remote_keyboard_interrupt_and_system_exit_reach_the_caller_as_exceptions(
    where: str, calls: tuple[str, ...]
) -> None:
    """A plain function (thread pool) or an ``async def`` (event loop) raising
    KeyboardInterrupt or SystemExit, through ``rpc_async``, ``remote()`` and
    ``@async_execution``: the callee keeps serving (and exits 0), and the caller gets an
    exception that ``except Exception`` catches, naming the original type."""
    seen = run_job(
        "fault_scenarios.remote_base_exceptions", env={"RAISE_WHERE": where}, timeout=60
    )[0].result
    for how in calls:
        for kind in ("KeyboardInterrupt", "SystemExit"):
            error = seen[f"{how} {kind}"]
            assert error.get("exception"), (how, kind, error)
            assert kind in error["message"], (how, kind, error)
            assert seen[f"alive after {how} {kind}"] == {"value": "w1"}, (how, kind, seen)
