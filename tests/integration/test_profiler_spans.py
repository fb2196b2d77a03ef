"""RPC calls as spans in torch.profiler's chrome traces (asyncrpc.agent.spans).

Two agents in this process, so one trace holds both sides of each call (the example
``profile_rpc``, run by tests/examples, checks two workers' separate traces).  The
profiler is entered on the test's event loop thread, as the agents' loop, either
tracing that thread alone (torch's default) or every thread (``profile_all_threads``).
"""

from __future__ import annotations

import asyncio
import json
import operator
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrpc import RPCTimeoutError
from asyncrpc.agent import AgentOptions, RpcAgent, inbound, spans
from asyncrpc.agent.spans import CALLER, QUEUED, RUN, match_calls
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(60)
NAP = 0.02  # seconds each function takes
US = 1e6
SLACK_US = 50.0  # spans that follow each other on one clock, measured apart


@pytest.fixture
async def pair() -> AsyncIterator[list[RpcAgent]]:
    async with joined_agents("ab", AgentOptions(transports=("unix",), rpc_timeout=10)) as agents:
        yield agents


async def sleepy(x: int) -> int:
    await asyncio.sleep(NAP)
    return x + 1


def blocking(x: int) -> torch.Tensor:
    time.sleep(NAP)
    return torch.ones(4) * x


def fail() -> None:
    raise ValueError("no")


async def hang() -> None:
    await asyncio.Event().wait()


def _name(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def profiler(all_threads: bool) -> torch.profiler.profile:
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=all_threads)
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config
    )


def traced(prof: torch.profiler.profile, path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """The RPC spans of the profiler's chrome trace, by call tag and kind."""
    prof.export_chrome_trace(str(path))
    return match_calls(json.loads(path.read_text()))


def assert_served_in_order(kinds: dict[str, dict[str, Any]]) -> None:
    """Caller span around the callee's queued then run spans, one after the other."""
    caller, queued, run = kinds[CALLER], kinds[QUEUED], kinds[RUN]
    for event in (caller, queued, run):
        assert event["args"].get("finished", True), event  # ended, not cut at the stop
    assert caller["ts"] <= queued["ts"]
    assert queued["ts"] + queued["dur"] <= run["ts"] + SLACK_US
    assert run["ts"] + run["dur"] <= caller["ts"] + caller["dur"] + SLACK_US
    assert caller["dur"] >= run["dur"] >= 0.9 * NAP * US


@pytest.mark.parametrize("all_threads", [False, True], ids=["loop-thread", "all-threads"])
async def test_a_call_is_a_caller_span_and_callee_queued_and_run_spans_with_one_tag(
    pair: list[RpcAgent], tmp_path: Path, all_threads: bool
) -> None:
    a, _ = pair
    await a.rpc_async("b", blocking, (0,))  # links up, pool warm: outside the trace
    with profiler(all_threads) as prof:
        results = await asyncio.gather(
            a.rpc_async("b", sleepy, (1,)), a.rpc_async("b", blocking, (2,))
        )
    assert results[0] == 2 and results[1].tolist() == [2.0] * 4
    calls = traced(prof, tmp_path / "trace.json")
    assert set(calls) == {"2@a", "3@a"}, calls
    for tag, fn in (("2@a", sleepy), ("3@a", blocking)):
        kinds = calls[tag]
        assert kinds[CALLER]["name"] == f"rpc_async#{_name(fn)} -> b [call {tag}]"
        assert kinds[QUEUED]["name"] == f"rpc_queued#{_name(fn)} <- a [call {tag}]"
        assert kinds[RUN]["name"] == f"rpc_run#{_name(fn)} <- a [call {tag}]"
        assert_served_in_order(kinds)
    loop_thread = calls["2@a"][CALLER]["tid"]
    assert calls["2@a"][RUN]["tid"] == loop_thread  # an async def runs on the loop
    pool_run = calls["3@a"][RUN]["tid"]
    assert (pool_run != loop_thread) is all_threads  # in the pool thread, if it is traced


@pytest.mark.parametrize("all_threads", [False, True], ids=["loop-thread", "all-threads"])
async def test_the_run_span_ends_before_the_reply_leaves(
    pair: list[RpcAgent], monkeypatch: pytest.MonkeyPatch, all_threads: bool
) -> None:
    """Then, in two workers' traces, the callee's run lies within the caller's span
    however the CPUs are shared: the caller's span cannot end before the reply left."""
    ended_when_sent: list[bool] = []
    send_result = inbound.Inbound._send_result

    def spying(self: inbound.Inbound, call: inbound.IncomingCall, result: Any) -> None:
        ended_when_sent.append(call.span is not None and call.span._ended)
        send_result(self, call, result)

    monkeypatch.setattr(inbound.Inbound, "_send_result", spying)
    a, _ = pair
    await a.rpc_async("b", sleepy, (0,))
    ended_when_sent.clear()
    with profiler(all_threads):
        assert await a.rpc_async("b", sleepy, (1,)) == 2  # a coroutine
        assert await a.rpc_async("b", operator.add, (1, 2)) == 3  # a pool call
    assert ended_when_sent == [True, True]


async def test_a_failed_or_timed_out_call_still_ends_its_spans(
    pair: list[RpcAgent], tmp_path: Path
) -> None:
    a, b = pair
    with profiler(False) as prof:
        with pytest.raises(ValueError, match="no"):
            await a.rpc_async("b", fail)
        with pytest.raises(RPCTimeoutError):
            await a.rpc_async("b", hang, timeout=NAP)
        while b._inbound.running:  # the CANCEL reached b: its call is over too
            await asyncio.sleep(0.005)
    calls = traced(prof, tmp_path / "trace.json")
    assert set(calls) == {"1@a", "2@a"}, calls
    for kinds in calls.values():
        assert set(kinds) == {CALLER, QUEUED, RUN}, kinds
        assert all(event["args"].get("finished", True) for event in kinds.values()), kinds
    assert calls["2@a"][CALLER]["dur"] >= 0.9 * NAP * US  # until its deadline


async def test_a_call_in_flight_when_the_profiler_stops_completes(pair: list[RpcAgent]) -> None:
    a, _ = pair
    with profiler(False):
        pending = [a.rpc_async("b", sleepy, (1,)), a.rpc_async("b", blocking, (1,))]
    assert (await pending[0]) == 2 and (await pending[1]).tolist() == [1.0] * 4


async def test_a_profiler_of_another_thread_gets_no_span_and_breaks_no_call(
    pair: list[RpcAgent], tmp_path: Path
) -> None:
    a, _ = pair
    prof = profiler(False)
    with ThreadPoolExecutor(1) as elsewhere:  # it traces that thread only, not the loop
        await asyncio.get_running_loop().run_in_executor(elsewhere, prof.start)
        try:
            results = await asyncio.gather(
                a.rpc_async("b", sleepy, (1,)), a.rpc_async("b", blocking, (1,))
            )
        finally:
            await asyncio.get_running_loop().run_in_executor(elsewhere, prof.stop)
    assert results[0] == 2 and results[1].tolist() == [1.0] * 4
    assert traced(prof, tmp_path / "trace.json") == {}


async def test_without_a_profiler_no_span_is_made(
    pair: list[RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    with profiler(False):  # one ran before: its end leaves nothing switched on
        await a.rpc_async("b", sleepy, (0,))

    touched: list[Any] = []

    def untouchable(*args: Any) -> None:
        touched.append(args)
        raise AssertionError("span machinery used without a profiler")

    monkeypatch.setattr(spans, "_RecordFunction", untouchable)
    monkeypatch.setattr(inbound, "ServedSpan", untouchable)
    assert not spans.profiling()
    results = await asyncio.gather(
        *(a.rpc_async("b", fn, (i,)) for i in range(5) for fn in (sleepy, blocking))
    )
    assert results[::2] == [1, 2, 3, 4, 5]
    assert [int(r[0]) for r in results[1::2]] == [0, 1, 2, 3, 4]
    assert touched == []
