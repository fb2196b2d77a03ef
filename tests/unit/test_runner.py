"""The runner: every placement runs in the call's context, catches alike, completes
once on the loop, and counts its pool threads back to zero."""

from __future__ import annotations

import ast
import asyncio
import contextvars
import inspect
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrpc.agent import inbound, runner
from asyncrpc.agent.dispatch import Placement, async_execution, describe, on_loop
from asyncrpc.agent.runner import Runner

pytestmark = pytest.mark.timeout(10)

where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="outside")


class Abort(BaseException):
    """Neither an Exception nor KeyboardInterrupt/SystemExit."""


def plain() -> str:
    return where.get()


async def coroutine() -> str:
    await asyncio.sleep(0)
    return where.get()


@async_execution
def ready_future() -> asyncio.Future[str]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(where.get())
    return future


@async_execution
def later_future() -> asyncio.Future[str]:
    future = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(future.set_result, where.get())
    return future


@async_execution
def torch_future() -> torch.futures.Future[str]:
    future: torch.futures.Future[str] = torch.futures.Future()
    future.set_result(where.get())
    return future


@on_loop
def inline() -> str:
    return where.get()


EVERY_PLACEMENT = [plain, coroutine, ready_future, later_future, torch_future, inline]


class Completion:
    """A ``done`` that records its outcome, and the context it ran in."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[bool, Any, str]] = []
        self.event = asyncio.Event()

    def __call__(self, ok: bool, value: Any) -> None:
        self.outcomes.append((ok, value, where.get()))
        self.event.set()

    async def outcome(self) -> tuple[bool, Any, str]:
        await asyncio.wait_for(self.event.wait(), 5)
        for _ in range(3):  # (a second completion would show up here)
            await asyncio.sleep(0)
        assert len(self.outcomes) == 1
        return self.outcomes[0]


@pytest.fixture
async def pool_runner() -> AsyncIterator[Runner]:
    made = Runner(2, "test")
    yield made
    made.close()


def call_context() -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(where.set, "inside")
    return context


def run(runner: Runner, func: Callable[..., Any], *args: Any) -> Completion:
    done = Completion()
    placement, name = describe(func)
    runner.run(placement, func, args, {}, name=name, context=call_context(), done=done)
    return done


@pytest.mark.parametrize("func", EVERY_PLACEMENT, ids=lambda f: f.__name__)
async def test_every_placement_runs_and_completes_in_the_calls_context(
    pool_runner: Runner, func: Callable[..., Any]
) -> None:
    assert await run(pool_runner, func).outcome() == (True, "inside", "inside")
    assert where.get() == "outside"


def raise_it(exc: BaseException) -> None:
    raise exc


async def raise_it_later(exc: BaseException) -> None:
    await asyncio.sleep(0)
    raise exc


@async_execution
def raise_it_on_call(exc: BaseException) -> None:
    raise exc


@async_execution
def fail_a_future(exc: BaseException) -> asyncio.Future[None]:
    future = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(future.set_exception, exc)
    return future


@on_loop
def raise_it_inline(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize(
    "func",
    [raise_it, raise_it_later, raise_it_on_call, fail_a_future, raise_it_inline],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("exc_type", [ValueError, SystemExit, Abort])
async def test_every_placement_catches_whatever_the_call_raises(
    pool_runner: Runner, func: Callable[..., Any], exc_type: type[BaseException]
) -> None:
    raised = exc_type("boom")
    ok, value, context = await run(pool_runner, func, raised).outcome()
    assert (ok, value, context) == (False, raised, "inside")
    assert pool_runner.slow_threads_busy == 0


async def test_a_cancelled_task_completes_as_cancelled(pool_runner: Runner) -> None:
    started = asyncio.Event()

    async def wait_forever() -> None:
        started.set()
        await asyncio.Event().wait()

    done = Completion()
    cancel = pool_runner.run(
        Placement.LOOP, wait_forever, (), {}, name="wait", context=call_context(), done=done
    )
    assert cancel is not None
    await asyncio.wait_for(started.wait(), 5)
    cancel.cancel()
    ok, value, context = await done.outcome()
    assert (ok, type(value), context) == (False, asyncio.CancelledError, "inside")


async def test_a_task_cancelled_before_its_first_step_closes_the_calls_coroutine(
    pool_runner: Runner,
) -> None:
    """A call cancelled in the turn it arrived (its link lost, or its caller gone) never
    starts; its coroutine is closed, not left to be reported as never awaited when
    collected."""
    made: list[Any] = []

    def call() -> Any:
        made.append(coroutine())
        return made[-1]

    done = Completion()
    handle = pool_runner.run(
        Placement.LOOP, call, (), {}, name="c", context=call_context(), done=done
    )
    assert isinstance(handle, asyncio.Task)
    runner.cancel_call(handle)
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED
    assert done.outcomes == []  # nobody waits for a call cancelled this way


@pytest.mark.parametrize("waits", [False, True], ids=["at once", "after a wait"])
async def test_a_coroutine_completes_outside_any_exception_handler(
    pool_runner: Runner, waits: bool
) -> None:
    """Its result reaches ``done`` by a StopIteration; were ``done`` called while that is
    being handled, an error ``done`` raises (a reply too large, say) would carry it, and
    the result in it, as its context (the caller then got no reply that fit)."""
    handling: list[object] = []

    async def result() -> bytes:
        if waits:
            await asyncio.sleep(0)
        return b"x" * 100

    def done(ok: bool, value: Any) -> None:
        handling.append(sys.exc_info()[1])

    pool_runner.run(Placement.LOOP, result, (), {}, name="r", context=call_context(), done=done)
    for _ in range(5):
        await asyncio.sleep(0)
    assert handling == [None]


async def test_a_coroutine_call_runs_in_a_task_of_its_own(pool_runner: Runner) -> None:
    """From its first step: asyncio.timeout and TaskGroup need a current task, and
    handlers use them (running the first step eagerly, outside any task, broke them)."""

    async def timed() -> bool:
        async with asyncio.timeout(5), asyncio.TaskGroup() as group:
            group.create_task(asyncio.sleep(0))
        return asyncio.current_task() is not None

    done = Completion()
    cancel = pool_runner.run(
        Placement.LOOP, timed, (), {}, name="timed", context=call_context(), done=done
    )
    assert cancel is not None
    assert await done.outcome() == (True, True, "inside")


async def test_an_awaitable_call_returning_no_awaitable_fails_that_call(
    pool_runner: Runner,
) -> None:
    @async_execution
    def not_awaitable() -> int:
        return 3

    ok, value, _ = await run(pool_runner, not_awaitable).outcome()
    assert not ok
    assert isinstance(value, TypeError)
    assert "not an awaitable" in str(value)


async def test_pool_calls_count_as_slow_until_proven_quick(
    pool_runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "SPIN_BELOW", 60.0)  # every call that has run once is quick
    gate, started = threading.Event(), threading.Semaphore(0)

    def held() -> None:
        started.release()
        assert gate.wait(5)

    first = run(pool_runner, held)
    assert started.acquire(timeout=5)
    assert pool_runner.slow_threads_busy == 1  # never ran: not known to be quick
    gate.set()
    assert (await first.outcome())[0]
    assert pool_runner.slow_threads_busy == 0
    gate.clear()
    again = run(pool_runner, held)
    assert started.acquire(timeout=5)
    assert pool_runner.slow_threads_busy == 0  # proven quick: the loop may spin for it
    gate.set()
    assert (await again.outcome())[0]


async def test_a_failing_completion_does_not_strand_the_others() -> None:
    one_thread = Runner(1, "test")
    done = [Completion() for _ in range(4)]
    ran = threading.Event()

    def broken(ok: bool, value: Any) -> None:
        raise RuntimeError("a bug in a completion")

    one_thread.run(Placement.THREAD, int, (9,), {}, name="int", context=call_context(), done=broken)
    for i, completion in enumerate(done[:3]):
        one_thread.run(
            Placement.THREAD, int, (i,), {}, name="int", context=call_context(), done=completion
        )
    one_thread.run(
        Placement.THREAD, ran.set, (), {}, name="set", context=call_context(), done=done[3]
    )
    assert ran.wait(5)  # holding the loop: the calls before it are completed in one batch
    outcomes = [(await completion.outcome())[:2] for completion in done]
    assert outcomes == [(True, 0), (True, 1), (True, 2), (True, None)]
    assert one_thread.slow_threads_busy == 0
    one_thread.close()


@pytest.mark.parametrize("module", [inbound, runner], ids=lambda m: m.__name__)
def test_serving_does_not_import_the_agent(module: Any) -> None:
    source = Path(__file__).parents[2].joinpath(*module.__name__.split(".")).with_suffix(".py")
    tree = ast.parse(source.read_text())  # the source: the module may load compiled
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
    }
    assert "asyncrpc.agent.agent" not in imported
