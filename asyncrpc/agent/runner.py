"""Running a function where its placement says, and reporting how it ended.

Theory of operation
-------------------
Both serving paths -- a call that came from a peer and one run locally "as an
incoming call would run" (:class:`~asyncrpc.agent.inbound.Inbound` has both) --
hand the :class:`Runner` the function, its arguments, the ``contextvars``
context the call runs in and a completion callback ``done(ok, value)``.  So
they place, count, catch and complete alike; what ``done`` does is theirs (an
incoming call replies, a local one resolves a future).  For every placement:

* Everything of a call runs in its context: the function, every step of the
  coroutine or awaitable it returns, and ``done``.
* ``done`` runs once, on the loop: ``done(True, result)``, or ``done(False,
  exc)`` with whatever the call raised.  That is any ``BaseException``: a
  ``KeyboardInterrupt`` or ``SystemExit`` from user code ends that call, never
  the worker.  An ``asyncio.CancelledError`` says the call's task or awaitable
  was cancelled.  (Two exceptions: a task cancelled before its first step
  never runs, and a coroutine closed unfinished, which only happens when its
  loop goes away; neither completes, and whoever cancelled knows.)
* Running returns what cancels the call, where anything can: the task of a
  coroutine, or the future an awaitable call returned; else None.

Where each placement runs:

* THREAD -- the worker's pool.  The outcome joins a queue, and one
  ``call_soon_threadsafe`` wakes the loop for however many are queued by then.
  How long the last run under each name (a function's; offload's kind) took is
  kept: while only calls that proved quick (under ``SPIN_BELOW``) are in the
  pool, ``slow_threads_busy`` is 0 and the agent's loop may busy-poll for their
  outcomes; a slow one would have to share the GIL with a spinning loop, so
  while one runs the loop sleeps.  A pool thread cannot be interrupted:
  cancelling such a call is up to ``done`` (drop the outcome).
* LOOP and AWAITABLE -- called on the loop.  A coroutine (what an ``async def``
  returns, or an ``@async_execution`` function may) runs in one wrapper task
  that completes the call in the step the coroutine finishes (a done callback
  would cost one more loop turn); an asyncio or torch future completes it when
  done, in this turn if it already is.
* INLINE -- called on the loop at once; it completes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from functools import partial
from inspect import CORO_CREATED
from types import CoroutineType
from typing import Any

import torch

from asyncrpc.agent.dispatch import Placement
from asyncrpc.agent.pool import WorkerPool

log = logging.getLogger("asyncrpc.agent")

SPIN_BELOW = 200e-6  # seconds: a pool call this quick is waited for by busy-polling
_KINDS_KEPT = 1024  # learnt run times kept (forgotten all at once past this)

Done = Callable[[bool, Any], None]
"""A call's completion: ``done(True, result)`` or ``done(False, exception)``."""


@dataclass(slots=True)
class PoolCall:
    """A THREAD call on its way through the pool: made on the loop, run in a pool
    thread (which sets its outcome), completed back on the loop."""

    name: Hashable  # what its run time is learnt under
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    context: contextvars.Context
    done: Done
    slow: bool  # counted in Runner.slow_threads_busy until completed
    ok: bool = False
    value: Any = None  # the result, or the exception raised


class Runner:
    """Runs calls by placement for one worker (see the module docstring)."""

    def __init__(self, threads: int, name: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._pool = WorkerPool(threads, name)
        self._finished: deque[PoolCall] = deque()
        self._lock = threading.Lock()
        self._drain_scheduled = False
        self.slow_threads_busy = 0  # pool calls not proven quick, not yet completed
        self._took: dict[Hashable, float] = {}  # seconds the last run of a name (or kind) took

    def run(
        self,
        placement: Placement,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        name: Hashable,
        context: contextvars.Context,
        done: Done,
    ) -> asyncio.Future[Any] | None:
        """Run ``func(*args, **kwargs)`` in ``context`` where ``placement`` says; ``done``
        gets its outcome.  ``name``: what its run time is learnt under, and the
        function in error messages.  Returns what cancels the call, if anything can."""
        if placement is Placement.THREAD:
            slow = self._took.get(name, SPIN_BELOW) >= SPIN_BELOW
            self.slow_threads_busy += slow
            self._pool.submit(
                self._in_thread, PoolCall(name, func, args, kwargs, context, done, slow)
            )
            return None
        try:
            returned = context.run(func, *args, **kwargs)
        except BaseException as exc:
            context.run(done, False, exc)
            return None
        if placement is Placement.INLINE:
            context.run(done, True, returned)
            return None
        return self._complete_when_done(returned, name, context, done)

    # -- learnt run times ------------------------------------------------------------

    def took(self, key: Hashable) -> float | None:
        """Seconds the last run learnt under ``key`` took, if known."""
        return self._took.get(key)

    def learn(self, key: Hashable, seconds: float) -> None:
        if len(self._took) >= _KINDS_KEPT:
            self._took.clear()
        self._took[key] = seconds

    @property
    def pool_stats(self) -> dict[str, int]:
        """The pool's threads, busy ones and queued jobs."""
        return self._pool.stats

    def close(self) -> None:
        """Stop the pool's threads once their current calls end; queued ones never run."""
        self._pool.shutdown()

    # -- THREAD ----------------------------------------------------------------------

    def _in_thread(self, call: PoolCall) -> None:
        """In a pool thread: run the call, then queue it for the loop."""
        started = time.perf_counter()
        try:
            call.value = call.context.run(call.func, *call.args, **call.kwargs)
            call.ok = True
        except BaseException as exc:
            call.value = exc
        call.args, call.kwargs = (), {}  # they may hold a peer's segments: released first
        self.learn(call.name, time.perf_counter() - started)
        self._finished.append(call)
        with self._lock:
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        with contextlib.suppress(RuntimeError):  # loop closed: the agent has shut down
            self._loop.call_soon_threadsafe(self._complete_finished)

    def _complete_finished(self) -> None:
        """On the loop: complete every call queued by the pool (one wake-up per batch)."""
        with self._lock:
            self._drain_scheduled = False
        while self._finished:
            call = self._finished.popleft()
            self.slow_threads_busy -= call.slow
            try:
                call.context.run(call.done, call.ok, call.value)
            except Exception:  # a completion's own bug must not strand the others
                log.exception("completing %s failed", call.name)

    # -- LOOP and AWAITABLE ----------------------------------------------------------

    def _complete_when_done(
        self, returned: Any, name: Hashable, context: contextvars.Context, done: Done
    ) -> asyncio.Future[Any] | None:
        """Complete the call when what it returned (a coroutine, or an asyncio or torch
        future) is done; what cancels it."""
        if type(returned) is CoroutineType or isinstance(returned, Coroutine):  # (ABC: slower)
            return self._loop.create_task(_complete_when_finished(returned, done), context=context)
        try:
            future = self._as_future(returned, name)
        except TypeError as exc:
            context.run(done, False, exc)
            return None
        if future.done():  # finished on the spot (a quick step, say): complete in this turn
            context.run(_complete_from, done, future)
        else:
            future.add_done_callback(partial(_complete_from, done), context=context)
        return future

    def _as_future(self, awaitable: Any, name: Hashable) -> asyncio.Future[Any]:
        if isinstance(awaitable, torch._C.Future):  # also what Future.then() returns
            future = self._loop.create_future()

            def copy(source: torch._C.Future[Any]) -> None:
                self._loop.call_soon_threadsafe(_copy_torch_future, source, future)

            awaitable.add_done_callback(copy)
            return future
        if asyncio.isfuture(awaitable):
            # Callers often share one future (a batch): cancelling this call's view of
            # it (its caller timed out, or its link was lost) must not cancel it for
            # the others.  Nor, once this call is gone, may its error go unseen
            # ("exception was never retrieved"): the call reported, or dropped, it.
            awaitable.add_done_callback(mark_retrieved)
            return asyncio.shield(awaitable)
        raise TypeError(
            f"async_execution function {name} returned "
            f"{type(awaitable).__name__}, not an awaitable "
            "(asyncio future, coroutine or torch.futures.Future)"
        )


async def _complete_when_finished(coroutine: Coroutine[Any, Any, Any], done: Done) -> None:
    """Await a call's coroutine and complete the call in the step it finishes."""
    try:
        result = await coroutine
    except GeneratorExit:  # closed unfinished: its loop is going away
        raise
    except BaseException as exc:  # SystemExit too: it ends this call, not the worker
        done(False, exc)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return
    done(True, result)


def cancel_call(handle: asyncio.Future[Any]) -> None:
    """Cancel a running call by what ``Runner.run`` returned for it.  A task cancelled
    before its first step never starts the call's coroutine, which would then be
    reported as never awaited when collected: that coroutine is closed here instead."""
    handle.cancel()
    wrapper = handle.get_coro() if isinstance(handle, asyncio.Task) else None
    if inspect.iscoroutine(wrapper) and inspect.getcoroutinestate(wrapper) == CORO_CREATED:
        call = inspect.getcoroutinelocals(wrapper).get("coroutine")
        if inspect.iscoroutine(call):
            call.close()


def _complete_from(done: Done, future: asyncio.Future[Any]) -> None:
    if future.cancelled():
        done(False, asyncio.CancelledError())
    elif (error := future.exception()) is not None:
        done(False, error)
    else:
        done(True, future.result())


def mark_retrieved(future: asyncio.Future[Any]) -> None:
    """Mark an outcome nobody waits for any more as seen (whoever wanted it has it, or
    is gone), so that asyncio does not log its error as never retrieved."""
    if not future.cancelled():
        future.exception()


def _copy_torch_future(source: torch._C.Future[Any], target: asyncio.Future[Any]) -> None:
    if target.done():
        return
    try:
        target.set_result(source.value())
    except BaseException as exc:
        target.set_exception(exc)
