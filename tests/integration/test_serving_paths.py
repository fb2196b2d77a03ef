"""The two serving paths -- a call from a peer and ``RpcAgent.invoke`` -- behave alike
for every placement: the caller's propagated context, what a call may raise, and the
count of busy pool threads."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from asyncrpc import RemoteError
from asyncrpc.agent import AgentOptions, RpcAgent, async_execution, on_loop, propagate, runner
from tests.in_process import joined_agents

pytestmark = pytest.mark.timeout(30)

carried: contextvars.ContextVar[str | None] = contextvars.ContextVar("carried", default=None)
propagate("tests.serving_paths", carried)

Path = Callable[[RpcAgent, RpcAgent, Callable[..., Any], tuple[Any, ...]], Awaitable[Any]]


def from_a_peer(a: RpcAgent, b: RpcAgent, func: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return a.rpc_async("b", func, args)


def invoked(a: RpcAgent, b: RpcAgent, func: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return b.invoke(func, args)


PATHS = [from_a_peer, invoked]


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RpcAgent, RpcAgent]]:
    async with joined_agents("ab", AgentOptions(transports=("unix",), rpc_timeout=10)) as agents:
        yield agents[0], agents[1]


def in_thread() -> str | None:
    return carried.get()


async def in_task() -> str | None:
    await asyncio.sleep(0)
    return carried.get()


@async_execution
def awaitable() -> asyncio.Future[str | None]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(carried.get())
    return future


@on_loop
def inline() -> str | None:
    return carried.get()


class MadeInContext:
    """An ``async`` callable (so placed LOOP) whose coroutine is made by code that reads
    the context: only a call made *in* the call's context sees the caller's value."""

    def __init__(self) -> None:
        vars(self)["__call__"] = self._run  # what placement looks at: a coroutine function

    async def _run(self, seen: str | None) -> str | None:
        return seen

    def __call__(self) -> Any:  # what calling it runs
        return self._run(carried.get())

    def __reduce__(self) -> Any:
        return MadeInContext, ()


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.__name__)
@pytest.mark.parametrize(
    "func",
    [in_thread, in_task, awaitable, inline, MadeInContext()],
    ids=lambda f: getattr(f, "__name__", type(f).__name__),
)
async def test_every_placement_runs_in_the_callers_propagated_context(
    pair: tuple[RpcAgent, RpcAgent], path: Path, func: Callable[..., Any]
) -> None:
    token = carried.set("the caller's")
    try:
        seen = await path(*pair, func, ())
    finally:
        carried.reset(token)
    assert seen == "the caller's"


class Abort(BaseException):
    """Neither an Exception nor KeyboardInterrupt/SystemExit."""


def raise_it(exc: BaseException) -> None:
    raise exc


async def raise_in_task(exc: BaseException) -> None:
    await asyncio.sleep(0)
    raise exc


@async_execution
def raise_on_call(exc: BaseException) -> None:
    raise exc


@on_loop
def raise_inline(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("func", [raise_it, raise_in_task, raise_on_call, raise_inline])
@pytest.mark.parametrize("exc_type", [SystemExit, Abort])
async def test_a_call_that_raises_no_exception_fails_that_call_alike(
    pair: tuple[RpcAgent, RpcAgent],
    path: Path,
    func: Callable[..., Any],
    exc_type: type[BaseException],
) -> None:
    with pytest.raises(RemoteError, match=f"{exc_type.__name__}: stop"):
        await path(*pair, func, (exc_type("stop"),))
    assert await path(*pair, in_thread, ()) is None  # the worker serves on
    assert pair[1]._inbound.slow_threads_busy == 0


async def test_invoke_cancels_a_task_when_its_future_is_cancelled(
    pair: tuple[RpcAgent, RpcAgent],
) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def wait_forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = pair[1].invoke(wait_forever)
    await asyncio.wait_for(started.wait(), 5)
    future.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)


gate = threading.Event()
started = threading.Semaphore(0)


def held_when(hold: bool) -> None:
    if hold:
        started.release()
        assert gate.wait(10)


@pytest.mark.parametrize("learnt_by", PATHS, ids=lambda p: f"learnt_{p.__name__}")
async def test_pool_threads_are_counted_alike(
    pair: tuple[RpcAgent, RpcAgent], learnt_by: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function that proved quick, by either path, does not stop the callee's loop
    busy-polling while it runs again by either path; and the count returns to zero."""
    monkeypatch.setattr(runner, "SPIN_BELOW", 60.0)  # a function that ran once is quick
    a, b = pair
    gate.clear()
    await learnt_by(a, b, held_when, (False,))
    calls = [path(a, b, held_when, (True,)) for path in PATHS]
    for _ in calls:  # (the loop must keep serving meanwhile)
        assert await asyncio.to_thread(started.acquire, timeout=10)
    assert b._inbound.slow_threads_busy == 0
    gate.set()
    await asyncio.gather(*calls)
    assert b._inbound.slow_threads_busy == 0
