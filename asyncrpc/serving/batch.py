"""``@batch``: many callers' single items become one call of a function over a list.

Theory of operation
-------------------
A :class:`BatchedFunction` is a coroutine function of one item, so it is
served as a task on the callee's loop: it queues the item and waits for that
item's result.  Each serving agent keeps one
:class:`Batcher` per batched function (in the :class:`BatchService`
extension; a process without an agent keeps one per event loop).  The
batcher's :class:`~asyncrpc.serving.queue.BatchQueue` says when a batch is
due; the batcher then runs the function over the batch's items where the
function's own placement says (a plain function in the worker's thread pool,
an ``async def`` as a task on the loop) and hands each caller its slot of the
result.  At most ``max_concurrent`` batches run at once; items that arrive
meanwhile wait, so the busier the service, the fuller its batches.

Outcomes, per batch:

* a result of the right length: slot ``i`` is caller ``i``'s result, or its
  error when the slot holds an exception;
* an exception raised by the function: every caller of the batch gets it;
* a result of another length: every caller gets a ``ValueError`` naming the
  function.

A caller that gives up (a timeout, a cancel, its CANCEL from a remote caller)
before its batch starts is taken out of the queue; once the batch started, its
slot is dropped.  A full queue refuses a call at once with
:class:`~asyncrpc.errors.OverloadedError`.

The batch runs in a context of its own, never in one caller's: it serves many
callers, and a caller's distributed autograd context (or any other propagated
variable) is not the others'.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from asyncrpc.agent import RpcAgent, current_agent, on_loop_thread
from asyncrpc.agent.dispatch import function_name
from asyncrpc.errors import AgentStateError
from asyncrpc.serving.queue import BatchQueue, check_limits

T = TypeVar("T")
R = TypeVar("R")
RunBatch = Callable[[list[Any]], "asyncio.Future[Any]"]


class Batcher:
    """One batched function's queue and running batches, on one loop."""

    def __init__(
        self, queue: BatchQueue[Any], max_concurrent: int, run: RunBatch, worker: str
    ) -> None:
        self._queue = queue
        self._max_concurrent = max_concurrent
        self._run = run
        self._worker = worker
        self._loop = asyncio.get_running_loop()
        self._callers: dict[int, asyncio.Future[Any]] = {}  # ticket -> its caller's future
        self._timer: asyncio.Handle | None = None
        self._running = 0
        self._own_context = contextvars.Context()  # batches run in no caller's context
        self.sizes: Counter[int] = Counter()  # batch size -> how many batches had it

    def submit(self, item: Any) -> asyncio.Future[Any]:
        """Queue ``item``; a future of its result.  Raises OverloadedError when full."""
        ticket = self._queue.put(item, self._loop.time())
        future = self._loop.create_future()
        self._callers[ticket] = future
        future.add_done_callback(functools.partial(self._gave_up, ticket))
        self._schedule()
        return future

    def limit(self, *, max_size: int, max_wait: float, max_queue: int) -> None:
        """New limits for the batches formed from now on (any thread)."""
        self._queue.max_size, self._queue.max_wait = max_size, max_wait
        self._queue.max_queue = max_queue
        if on_loop_thread(self._loop):
            self._schedule()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._schedule, context=self._own_context)

    def stats(self) -> dict[str, Any]:
        """Batches run by size, items served, and what waits and runs now."""
        return {
            "batches": sum(self.sizes.values()),
            "items": sum(size * n for size, n in self.sizes.items()),
            "sizes": dict(sorted(self.sizes.items())),
            "waiting": len(self._queue),
            "running": self._running,
        }

    def close(self) -> None:
        """The worker is going away: every waiting caller fails."""
        if self._timer is not None:
            self._timer.cancel()
        closed = AgentStateError(
            f"worker {self._worker!r} shut down before running batched function {self._queue.name}",
            worker=self._worker,
            function=self._queue.name,
        )
        for ticket in list(self._callers):
            if self._queue.drop(ticket):
                self._callers.pop(ticket).set_exception(closed)

    def _gave_up(self, ticket: int, future: asyncio.Future[Any]) -> None:
        """A caller's future is done: if it gave up while waiting, take its item out."""
        if future.cancelled() and self._queue.drop(ticket):
            del self._callers[ticket]
            self._schedule()

    def _schedule(self) -> None:
        """(Re)arm the one timer for when the next batch is due."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        due = self._queue.due_in(self._loop.time())
        if due is None or self._running >= self._max_concurrent:
            return  # nothing waits, or a finishing batch calls again
        if due == 0:
            self._timer = self._loop.call_soon(self._start_due, context=self._own_context)
        else:
            self._timer = self._loop.call_later(due, self._start_due, context=self._own_context)

    def _start_due(self) -> None:
        self._timer = None
        while self._running < self._max_concurrent and self._queue.due_in(self._loop.time()) == 0:
            self._start(self._queue.take())
        self._schedule()

    def _start(self, batch: list[tuple[int, Any]]) -> None:
        callers = [self._callers.pop(ticket) for ticket, _ in batch]
        self.sizes[len(batch)] += 1
        self._running += 1
        try:
            outcome = self._run([item for _, item in batch])
        except Exception as exc:  # the runner itself refused (the agent is closing, say)
            outcome = self._loop.create_future()
            outcome.set_exception(exc)
        outcome.add_done_callback(
            functools.partial(self._finished, callers), context=self._own_context
        )

    def _finished(self, callers: list[asyncio.Future[Any]], outcome: asyncio.Future[Any]) -> None:
        self._running -= 1
        try:
            _deliver(self._queue.name, callers, outcome)
        finally:
            self._schedule()


def _deliver(name: str, callers: list[asyncio.Future[Any]], outcome: asyncio.Future[Any]) -> None:
    """Hand each caller still waiting its slot of the batch's outcome."""
    if outcome.cancelled():
        failure: BaseException | None = AgentStateError(f"batched function {name} was cancelled")
    else:
        failure = outcome.exception()
    if failure is None:
        results = outcome.result()
        failure = _length_error(name, results, len(callers))
    for index, caller in enumerate(callers):
        if caller.done():
            continue  # it gave up after the batch started
        if failure is not None:
            caller.set_exception(failure)
            continue
        result = results[index]
        if isinstance(result, BaseException):
            caller.set_exception(result)
        else:
            caller.set_result(result)


def _length_error(name: str, results: Any, expected: int) -> ValueError | None:
    try:
        length = len(results)
    except TypeError:
        length = None
    if length == expected:
        return None
    got = f"{length} results" if length is not None else f"a {type(results).__name__}"
    return ValueError(
        f"batched function {name} returned {got} for a batch of {expected} items; "
        "it must return one result per item, in order"
    )


class BatchService:
    """An agent's batchers, one per batched function (an agent extension)."""

    KEY = "batch"

    def __init__(self, agent: RpcAgent) -> None:
        self._agent = agent
        self._batchers: dict[BatchedFunction[Any, Any], Batcher] = {}

    def batcher(self, function: BatchedFunction[Any, Any]) -> Batcher:
        found = self._batchers.get(function)
        if found is None:
            found = self._batchers[function] = function.new_batcher(
                lambda items: self._agent.invoke(function.fn, (items,)),
                self._agent.info.name,
            )
        return found

    def find(self, function: BatchedFunction[Any, Any]) -> Batcher | None:
        return self._batchers.get(function)

    def peer_lost(self, rank: int) -> None:
        """Nothing to do: a lost caller's slot is dropped when its batch ends."""

    async def drain(self) -> None:
        """Nothing to do: by now every caller's call has ended."""

    def close(self) -> None:
        for batcher in self._batchers.values():
            batcher.close()

    def debug_info(self) -> dict[str, Any]:
        return {
            "batched_functions": {
                function.rpc_name: batcher.stats() for function, batcher in self._batchers.items()
            }
        }


class BatchedFunction(Generic[T, R]):
    """What :func:`batch` makes of a function: call it with one item, get its result.

    Pickled by reference (module and qualified name), as a plain function is, so it
    must be defined at module level or as a ``staticmethod`` of a module-level class.
    """

    def __init__(
        self,
        fn: Callable[[list[T]], Any],
        *,
        max_size: int,
        max_wait: float,
        max_queue: int,
        max_concurrent: int,
    ) -> None:
        functools.update_wrapper(self, fn)  # its name, module and docstring
        self.fn = fn
        self.rpc_name = function_name(fn)
        check_limits(self.rpc_name, max_size=max_size, max_wait=max_wait, max_queue=max_queue)
        if max_concurrent < 1:
            raise ValueError(f"batch {self.rpc_name}: max_concurrent must be >= 1")
        self.max_size, self.max_wait, self.max_queue = max_size, max_wait, max_queue
        self.max_concurrent = max_concurrent
        self._local: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Batcher] = (
            weakref.WeakKeyDictionary()
        )
        self._batchers: weakref.WeakSet[Batcher] = weakref.WeakSet()  # everywhere, to configure

    async def __call__(self, item: T) -> R:
        """Queue ``item`` for the next batch on this worker and wait for its result.

        (A coroutine, so it is served as a task on the loop: cancelling the task -- the
        caller timed out -- cancels the wait, which takes the item out of the queue.)"""
        result: R = await self._batcher().submit(item)
        return result

    def __reduce__(self) -> str:
        return self.fn.__qualname__  # a global: pickled by name, found by name

    def stats(self) -> dict[str, Any]:
        """This worker's figures for the function: batches run by size, items served,
        items waiting and batches running (empty before its first call here)."""
        agent = current_agent()
        if agent is not None:
            batcher = agent.extension(BatchService.KEY, BatchService).find(self)
        else:
            batcher = next((b for loop, b in self._local.items() if loop.is_running()), None)
        return batcher.stats() if batcher is not None else {}

    def configure(
        self,
        *,
        max_size: int | None = None,
        max_wait: float | None = None,
        max_queue: int | None = None,
    ) -> None:
        """Change the limits (those given) for the batches formed from now on, here and in
        every batcher of this process: a server that learns how many callers it has
        (a command-line option; observers that finished their episodes) says so.  A
        smaller ``max_size`` or ``max_wait`` may start a batch at once.  Any thread."""
        size = self.max_size if max_size is None else max_size
        wait = self.max_wait if max_wait is None else max_wait
        bound = self.max_queue if max_queue is None else max_queue
        check_limits(self.rpc_name, max_size=size, max_wait=wait, max_queue=bound)
        self.max_size, self.max_wait, self.max_queue = size, wait, bound
        for batcher in list(self._batchers):
            batcher.limit(max_size=size, max_wait=wait, max_queue=bound)

    def new_batcher(self, run: RunBatch, worker: str) -> Batcher:
        """A batcher for this function whose batches ``run`` runs."""
        queue = BatchQueue[Any](
            self.rpc_name, max_size=self.max_size, max_wait=self.max_wait, max_queue=self.max_queue
        )
        batcher = Batcher(queue, self.max_concurrent, run, worker)
        self._batchers.add(batcher)
        return batcher

    def _batcher(self) -> Batcher:
        agent = current_agent()
        if agent is not None and on_loop_thread(agent.loop):
            return agent.extension(BatchService.KEY, BatchService).batcher(self)
        loop = asyncio.get_running_loop()  # no agent serves here: batch on this loop
        found = self._local.get(loop)
        if found is None:
            found = self._local[loop] = self.new_batcher(self._run_here, "(no agent)")
        return found

    def _run_here(self, items: list[Any]) -> asyncio.Future[Any]:
        """Without an agent: a coroutine function as a task, a plain one in a thread."""
        loop = asyncio.get_running_loop()
        fn = self.fn
        if asyncio.iscoroutinefunction(fn):
            return loop.create_task(fn(items))
        return loop.run_in_executor(None, fn, items)


@overload
def batch(fn: Callable[[list[T]], Any], /) -> BatchedFunction[T, Any]: ...


@overload
def batch(
    *,
    max_size: int = ...,
    max_wait: float = ...,
    max_queue: int = ...,
    max_concurrent: int = ...,
) -> Callable[[Callable[[list[T]], Any]], BatchedFunction[T, Any]]: ...


def batch(
    fn: Callable[[list[T]], Any] | None = None,
    /,
    *,
    max_size: int = 32,
    max_wait: float = 0.005,
    max_queue: int = 1024,
    max_concurrent: int = 1,
) -> BatchedFunction[T, Any] | Callable[[Callable[[list[T]], Any]], BatchedFunction[T, Any]]:
    """Serve ``fn`` in batches: callers call it with one item, ``fn`` gets a list.

    ``fn(items)`` returns one result per item, in order (a list, or anything with a
    length and indexing, such as a tensor whose first dimension is the batch); an
    exception in slot ``i`` fails only caller ``i``.  A batch starts when
    ``max_size`` items wait or the oldest has waited ``max_wait`` seconds, and at
    most ``max_concurrent`` batches run at once.  Beyond ``max_queue`` waiting
    items a call fails at once with :class:`~asyncrpc.errors.OverloadedError`.
    ``async def`` functions run on the worker's loop, plain ones in its thread
    pool (never on the loop).  See docs/batching.md.

    Use as ``@batch`` or ``@batch(max_size=64, max_wait=0.002)``, on a module-level
    function or innermost under ``@staticmethod``; then
    ``await rpc_async("server", fn, args=(item,))``.
    """

    def decorate(fn: Callable[[list[T]], Any]) -> BatchedFunction[T, Any]:
        return BatchedFunction(
            fn,
            max_size=max_size,
            max_wait=max_wait,
            max_queue=max_queue,
            max_concurrent=max_concurrent,
        )

    return decorate if fn is None else decorate(fn)
