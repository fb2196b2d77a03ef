"""The compat layer's engine: asyncrpc's event loop in a background thread.

Theory of operation
-------------------
``torch.distributed.rpc`` is a blocking API; asyncrpc is an asyncio one.  The
compat layer runs one event loop (uvloop) in a daemon thread, the *loop thread*,
and the native agent lives on it.  Every compat function is one of three kinds:

* **start** (:func:`call`): run a short, non-blocking function on the loop thread
  and return what it returns (``rpc_async`` starts a call there and gets its
  asyncio future back).  From the loop thread itself it runs in place, so
  non-blocking compat functions work inside ``async def`` and
  ``@async_execution`` functions, which asyncrpc runs on the loop.
* **wait** (:func:`run`): run a coroutine on the loop and block until it is done.
  On the loop thread this would deadlock, so it raises
  :class:`~asyncrpc.AgentStateError` at once.
* **bridge** (:func:`to_torch_future`): an asyncio future (always completed on
  the loop thread) becomes a :class:`torch.futures.Future`.  Its outcome is set
  from a small pool of *completion threads*, never from the loop thread, because
  torch lets ``then()`` callbacks block (``fut.wait()``, ``rpc_sync``).

Errors cross every boundary through :func:`asyncrpc.compat.errors.convert`, so
compat callers see torch's ``RuntimeError`` family.  Contextvars cross with the
calls: ``call_soon_threadsafe`` runs its callback in a copy of the calling
thread's context, which carries the current distributed autograd context (and a
remote call's agent) into the coroutines started for that thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch
import uvloop

from asyncrpc.agent import RpcAgent, current_agent
from asyncrpc.compat.errors import convert
from asyncrpc.errors import AgentStateError

T = TypeVar("T")

_START_TIMEOUT = 30.0  # starting or stopping the loop thread: never waits longer


class Runtime:
    """One event loop in a daemon thread, plus the threads that complete torch futures."""

    def __init__(self, completion_threads: int) -> None:
        self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="asyncrpc-compat-loop", daemon=True)
        self.completions = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, completion_threads), thread_name_prefix="asyncrpc-compat-future"
        )
        self.thread.start()
        if not self._started.wait(_START_TIMEOUT):
            raise AgentStateError("the compat event loop thread did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on this runtime's loop thread."""
        return threading.get_ident() == self.thread.ident

    def stop(self) -> None:
        """Stop the loop and join its thread (pending callbacks are dropped)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(_START_TIMEOUT)
        if not self.thread.is_alive():
            self.loop.close()
        self.completions.shutdown(wait=False)


_runtime: Runtime | None = None


def start(completion_threads: int) -> Runtime:
    """Start the loop thread (once per ``init_rpc``)."""
    global _runtime
    if _runtime is not None:
        raise AgentStateError("asyncrpc.compat: init_rpc was already called; call shutdown first")
    _runtime = Runtime(completion_threads)
    return _runtime


def stop() -> None:
    """Stop the loop thread started by :func:`start` (no-op if none)."""
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.stop()


def running() -> Runtime:
    """The runtime, or ``AgentStateError`` when compat RPC is not initialised."""
    if _runtime is None:
        raise AgentStateError(
            "RPC has not been initialized: call `asyncrpc.compat.rpc.init_rpc(...)` first"
        )
    return _runtime


def agent() -> RpcAgent:
    """This process's agent, started by compat's ``init_rpc``; raises if there is none."""
    running()
    found = current_agent()
    if found is None:
        raise AgentStateError("RPC has not been initialized: call `rpc.init_rpc(...)` first")
    return found


def is_running() -> bool:
    """Whether compat RPC has a loop thread now."""
    return _runtime is not None


def call(fn: Callable[[], T], what: str = "call") -> T:
    """Run the non-blocking ``fn()`` on the loop thread and return its result (in place
    when already there); its exception is raised here, converted."""
    runtime = running()
    if runtime.on_loop_thread():
        try:
            return fn()
        except Exception as exc:
            raise convert(exc) from exc.__cause__
    return _wait_for(asyncio.run_coroutine_threadsafe(_as_coroutine(fn), runtime.loop), None, what)


async def _as_coroutine(fn: Callable[[], T]) -> T:
    return fn()


def run(start_: Callable[[], Awaitable[T]], what: str, limit: float | None = None) -> T:
    """Run ``start_()`` (an awaitable made on the loop) and block until it is done.

    ``limit`` (seconds, None or <= 0: none) only bounds how long this thread waits
    beyond the native call's own deadlines.  Raises on the loop thread."""
    runtime = running()
    refuse_on_loop(runtime, what)

    async def main() -> T:
        return await start_()

    return _wait_for(asyncio.run_coroutine_threadsafe(main(), runtime.loop), limit, what)


def refuse_on_loop(runtime: Runtime, what: str) -> None:
    """Raise if the caller is the loop thread, where a blocking wait would deadlock."""
    if runtime.on_loop_thread():
        raise AgentStateError(
            f"{what} blocks, and was called on asyncrpc's event loop thread (in an `async "
            "def` or `@async_execution` function), where it would deadlock: use the "
            "non-blocking form (rpc_async, rref.rpc_async(), Future.then) there"
        )


def _wait_for(future: concurrent.futures.Future[T], limit: float | None, what: str) -> T:
    bound = limit + 5.0 if limit is not None and limit > 0 else None
    try:
        return future.result(timeout=bound)
    except concurrent.futures.TimeoutError as exc:
        if not future.done():
            future.cancel()
            raise convert(AgentStateError(f"{what} got no answer in {limit}s")) from None
        raise convert(exc) from exc.__cause__
    except Exception as exc:
        raise convert(exc) from exc.__cause__


class Future(torch.futures.Future[T]):
    """A :class:`torch.futures.Future` whose ``wait()`` refuses the loop thread (where
    it would wait forever) instead of hanging."""

    def wait(self) -> T:
        """Block until the value is set; returns it or raises its error."""
        if not self.done() and _runtime is not None:
            refuse_on_loop(_runtime, "Future.wait()")
        return super().wait()


def to_torch_future(source: asyncio.Future[T]) -> Future[T]:
    """A torch future settled (from a completion thread) with ``source``'s outcome."""
    runtime = running()
    target: Future[T] = Future()

    def settle() -> None:
        if source.cancelled():
            target.set_exception(convert(AgentStateError("the call was cancelled")))  # type: ignore[arg-type]  # torch's stub types it T
            return
        error = source.exception()
        if error is not None:
            target.set_exception(convert(error))  # type: ignore[arg-type]  # as above
        else:
            target.set_result(source.result())

    def done(_: asyncio.Future[T]) -> None:
        runtime.completions.submit(settle)

    source.add_done_callback(done)
    return target


def start_torch_future(fn: Callable[[], asyncio.Future[T]], what: str) -> Future[T]:
    """``call(fn)`` and bridge the asyncio future it returns to a torch future."""
    return call(lambda: to_torch_future(fn()), what)


def value_or_none(timeout: float) -> float | None:
    """torch's timeouts to asyncrpc's: negative (``UNSET_RPC_TIMEOUT``) is the default
    (None), ``0`` is none (0), anything else is seconds."""
    return None if timeout < 0 else float(timeout)


def done_future(value: Any) -> Future[Any]:
    """A torch future already holding ``value``."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future
