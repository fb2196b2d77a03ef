"""Real multi-process jobs on loopback, over tcp and unix, on uvloop and asyncio."""

from __future__ import annotations

import pytest

from tests.cluster import run_job

pytestmark = pytest.mark.timeout(120)

COMBOS = [
    pytest.param("uvloop", "unix", id="uvloop-unix"),
    pytest.param("uvloop", "tcp", id="uvloop-tcp"),
    pytest.param("asyncio", "unix", id="asyncio-unix"),
    pytest.param("asyncio", "tcp", id="asyncio-tcp"),
]


@pytest.mark.parametrize(("loop", "transport"), COMBOS)
def test_basics(loop: str, transport: str) -> None:
    seen = run_job("basics", loop=loop, transport=transport)[0].result

    assert seen["torch_add"] == [2.0, 2.0, 2.0]
    assert seen["coroutines"] == 2 * sum(range(1000))
    assert seen["by_rank"] == seen["by_info"] == "w1"
    assert seen["to_self"] == "w0"
    assert seen["kwargs"] == 3
    assert seen["nested"] == "w1<-w0"
    assert seen["rpc_sync_in_thread"] == 42
    assert seen["rpc_sync_on_loop"]["error"] == "AgentStateError"
    assert "event loop thread" in seen["rpc_sync_on_loop"]["message"]
    assert seen["worker_info"] == [1, "w1"]
    assert seen["linked_at_init"] == ["w1"]  # init_rpc connected ahead of the first call
    debug = seen["debug"]
    assert debug["pending_outgoing_calls"] == 0
    assert "w1" in debug["connected_peers"]
    assert "running_incoming_calls" in debug


@pytest.mark.parametrize(("loop", "transport"), COMBOS[:2])
def test_errors_name_worker_function_and_cause(loop: str, transport: str) -> None:
    seen = run_job("basics", loop=loop, transport=transport)[0].result

    remote = seen["remote_value_error"]
    assert remote["error"] == "ValueError" and remote["message"] == "boom"
    assert remote["remote_worker"] == "w1"
    assert "fail" in remote["remote_traceback"] and "ValueError: boom" in remote["remote_traceback"]

    stand_in = seen["remote_unpicklable_error"]
    assert stand_in["error"] == "RemoteError" and "UnpicklableError" in stand_in["message"]

    assert seen["unpicklable_result"]["error"] in ("SerializationError", "RemoteError")
    assert "lock" in seen["unpicklable_result"]["message"]
    assert seen["unpicklable_argument"]["error"] == "SerializationError"
    assert seen["unknown_worker"]["error"] == "UnknownWorkerError"
    assert "nobody" in seen["unknown_worker"]["message"]
    assert "'w0' could not find destination" in seen["unknown_worker"]["message"]

    unknown = seen["unknown_function"]
    assert unknown["error"] == "SerializationError"
    assert "w1" in unknown["message"] and "only_on_caller" in unknown["message"]
    assert "does not serialize function code" in unknown["message"]

    for key in ("timeout", "thread_timeout"):
        assert seen[key]["error"] == "RPCTimeoutError" and seen[key]["timeout"]
        assert "w1" in seen[key]["message"]
    assert seen["alive_after_errors"] == "w1"


def test_tensors_and_async_execution() -> None:
    seen = run_job("basics")[0].result
    tensor_checks = {k: v for k, v in seen.items() if k.startswith("tensor_")}
    assert tensor_checks and all(tensor_checks.values()), tensor_checks
    assert seen["requires_grad_kept"] is True
    assert seen["nested_containers"] == [1.0, 1.0, 0.0]
    assert sorted(seen["batched"]) == [6] * 4 + [22] * 4
    assert seen["torch_future"] == [2.0, 2.0]
    assert seen["coroutine_awaitable"] == 6.0


def test_peer_killed_mid_call_fails_pending_calls_at_once() -> None:
    w0, _ = run_job("peer_killed", expect_exit={1: -9})
    seen = w0.result
    for key in ("killed", "in_flight", "later_call"):
        assert seen[key]["error"] == "PeerLostError", seen[key]
        assert seen[key]["connection"] and "w1" in seen[key]["message"]
    for key, function in (("killed", "die"), ("in_flight", "sleep_for")):  # each names its call
        assert f"during call to tests.scenarios.{function}: " in seen[key]["message"], seen[key]
    assert seen["burst_errors"] == ["PeerLostError"]  # 200 calls in flight, none lost
    assert seen["elapsed"] < 10  # the in-flight call's own timeout was 30 s
    assert seen["pending_after"] == 0
    assert seen["shutdown_seconds"] < 10


def test_bad_input_drops_only_that_connection() -> None:
    """Each hostile input goes on a connection the attacker keeps open for writing, so
    only the worker's reaction to the bytes can end it; a silent connection opened
    before them all stays open, and nothing they carry runs."""
    seen = run_job("bad_input")[0].result
    for attack in ("garbage", "oversized_header", "request_before_handshake"):
        assert seen[attack] == {"ended": "dropped", "received": 0}, (attack, seen[attack])
    mid_handshake = seen["request_mid_handshake"]
    assert mid_handshake["ended"] == "dropped", mid_handshake
    assert mid_handshake["received"] > 0, "the HELLO was answered (a CHALLENGE) before the drop"
    # A frame cut short is waited for, not acted on; the end of the stream ends it.
    assert seen["truncated_before_eof"] == "open"
    assert seen["truncated"] == {"ended": "dropped", "received": 0}
    assert seen["bystander"] == "open"
    assert seen["wrong_secret"]["connection"], seen["wrong_secret"]
    assert seen["still_serving"] == "w1"
    assert seen["control_command_ran"], "a command w1 runs leaves a file the test sees"
    assert not seen["command_ran"], "an unauthenticated peer's pickle ran on w1"


def test_a_burst_stays_within_the_shared_memory_budget_and_the_loop_responsive() -> None:
    """40 concurrent 8 MiB calls, 64 MiB budget: what does not fit goes through the
    socket, every call succeeds, and the caller's loop is never blocked for long (it
    was blocked while every tensor was copied into a fresh segment on it)."""
    seen = run_job("shm_budget")[0].result
    budget = seen["budget"]
    assert seen["correct"]
    shm = seen["shm"]
    assert shm["budget"] == budget
    assert seen["max_held_bytes"] <= budget and shm["peak_bytes"] <= budget
    assert 0 < shm["fallbacks"] < 40  # shared memory carried some, the socket the rest
    assert shm["segments_in_use"] + shm["segments_idle"] <= budget // (8 << 20)
    assert seen["max_loop_lag"] < 0.5, seen  # generous: a bound, not a benchmark
    assert seen["issue_seconds"] < 0.5, seen


def test_workers_exit_quietly_holding_tensors_received_through_shared_memory() -> None:
    # A tensor kept in a module global dies as the interpreter tears modules down: its
    # release must not fail there (it used to print two tracebacks at every such exit).
    workers = run_job("keep_received_until_exit")
    seen = workers[0].result
    assert seen["reply_sum"] == float(2 << 20)
    assert seen["lent_bytes"] >= 8 << 20  # the argument went through shared memory
    for w in workers:
        assert "Exception ignored" not in w.stderr and "Traceback" not in w.stderr, w.describe()


def test_a_worker_that_leaves_without_shutdown_holding_an_rref_exits_quietly() -> None:
    # Its RRef dies as the interpreter tears modules down, after the loop closed: the
    # owner learns of it from the lost link, and nothing may fail there.
    workers = run_job("leave_holding_an_rref")
    assert workers[0].result["value"] == 5
    assert "Exception ignored" not in workers[0].stderr, workers[0].describe()
    assert "Traceback" not in workers[0].stderr, workers[0].describe()


def test_graceful_shutdown_waits_for_peers() -> None:
    workers = run_job("graceful_shutdown")
    assert workers[0].result["results"] == [2 * i for i in range(20)]
    for w in workers:
        seen = w.result
        assert seen["state"] == "closed", seen
        assert seen["pending_outgoing_calls"] == 0, seen
    assert all("Traceback" not in w.stderr and "Warning" not in w.stderr for w in workers)
