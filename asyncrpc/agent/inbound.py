"""The serving side of an agent: incoming calls, from request frame to reply frame.

Theory of operation
-------------------
Each request becomes an :class:`IncomingCall` (its link, call id and function
name) and runs where :func:`~asyncrpc.agent.dispatch.describe` places it:

* THREAD -- the worker's pool.  The function *and* the serialisation of its
  result (with the copy of large buffers into shared memory, within the
  worker's budget) run in the pool thread; the encoded reply joins a
  completion queue, and one ``call_soon_threadsafe`` wakes the loop for however
  many replies are queued by then.  How long each function's last call took is
  kept: while only calls that proved quick (under ``SPIN_BELOW``) are in the
  pool, the agent's loop keeps busy-polling for their replies; a slow one would
  have to share the GIL with a spinning loop, so while one runs the loop sleeps.
* LOOP -- an ``async def``: a task on the loop.  Its reply is serialised on the
  loop; ``Link.send`` has large buffers copied into shared memory off the loop.
* AWAITABLE -- ``@async_execution``: called on the loop; the reply leaves when
  the returned awaitable completes (in the same turn if it already has).  Every
  coroutine (an ``async def`` call, or one returned by an ``async_execution``
  function) runs in one wrapper task that sends the reply in the step the
  coroutine finishes.
* INLINE -- ``@on_loop``: called on the loop at once; the reply leaves at once.

:meth:`Inbound.invoke` runs a function by the same placement rules for upper
layers (an RRef's value is made this way) and returns a future of its result.
:meth:`Inbound.offload` is for the framework's own compute (a backward piece, an
optimizer step), which a training loop runs again and again at the same size:
it learns how long each *kind* of job takes, and runs a kind that last took
under ``INLINE_BELOW`` on the loop, where a small job costs less than the trip
through a pool thread; a new kind, or a slow one, goes to the pool.  (Never for
user functions: one of those may block on the loop it would be running on.)

Every call ends in exactly one RESPONSE or ERROR frame, unless its link is
gone (then nobody is waiting).  A reply larger than the caller accepts (its
``max_frame_size``, announced in the handshake) is not sent: the call's ERROR
reply is the ``LocalProtocolError`` that says so, and the link stays up.  A
CANCEL from the caller (its deadline passed) cancels a task or awaitable; a
pool thread cannot be interrupted, and its late result is dropped.  Per link,
more than ``max_running`` calls in flight pause reading until half of them
have finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asyncrpc.agent.dispatch import Placement, as_exception, describe, pack_error
from asyncrpc.agent.outgoing import Outgoing
from asyncrpc.agent.pool import WorkerPool
from asyncrpc.agent.transfer import apply_carried, carried, dumps_reply, loads_request
from asyncrpc.errors import (
    LocalProtocolError,
    RemoteError,
    RemoteProtocolError,
    SerializationError,
)
from asyncrpc.transport import Link
from asyncrpc.wire import Frame, Kind

if TYPE_CHECKING:
    from asyncrpc.agent.agent import RpcAgent

log = logging.getLogger("asyncrpc.agent")
calls_log = logging.getLogger("asyncrpc.agent.calls")  # failed calls, on the callee (INFO)

# Seconds.  A trip through a pool thread costs two thread wake-ups (50 to 500 µs on small
# VMs); stalling the loop for less than a millisecond costs other calls no more than that.
INLINE_BELOW = 1e-3
SPIN_BELOW = 200e-6  # seconds: a pool call this quick is waited for by busy-polling
_KINDS_KEPT = 1024  # learnt job times kept (forgotten all at once past this)


@dataclass(frozen=True, slots=True)
class IncomingCall:
    link: Link
    call_id: int
    function: str


@dataclass(slots=True)
class _LinkCalls:
    running: dict[int, asyncio.Future[Any] | None] = field(default_factory=dict)
    paused: bool = False


class Inbound:
    """Runs the calls that arrive on a worker's accepted links."""

    def __init__(
        self, agent: RpcAgent, context: contextvars.Context, threads: int, max_running: int
    ) -> None:
        self.worker = worker = agent.info.name
        self.max_running = max_running
        self._agent = agent
        self._context = context
        self._loop = asyncio.get_running_loop()
        self._pool = WorkerPool(threads, f"asyncrpc-{worker}")
        self._links: dict[Link, _LinkCalls] = {}
        self._completions: deque[tuple[IncomingCall, bool, Any, Outgoing | None, bool]] = deque()
        self._lock = threading.Lock()
        self._drain_scheduled = False
        self.slow_threads_busy = 0  # pool jobs not proven quick, not yet back on the loop
        self._took: dict[Hashable, float] = {}  # seconds the last job of a kind (or function) took

    # -- links ---------------------------------------------------------------------

    def add_link(self, link: Link) -> None:
        self._links[link] = _LinkCalls()

    def drop_link(self, link: Link) -> None:
        """Forget a lost link and cancel what runs for it."""
        calls = self._links.pop(link, None)
        for future in calls.running.values() if calls else ():
            if future is not None:
                future.cancel()

    def link_from(self, name: str) -> Link | None:
        """An open link worker ``name`` dialed to us, if any."""
        return next((link for link in self._links if link.peer.name == name), None)

    @property
    def links(self) -> list[Link]:
        return list(self._links)

    @property
    def peers(self) -> set[str]:
        return {link.peer.name for link in self._links}

    @property
    def running(self) -> int:
        return sum(len(calls.running) for calls in self._links.values())

    def close(self) -> None:
        for link in list(self._links):
            self.drop_link(link)
            link.close()
        self._pool.shutdown()

    # -- frames --------------------------------------------------------------------

    def on_request(self, link: Link, frame: Frame) -> None:
        call_id = frame.meta.get("i")
        if type(call_id) is not int:
            link.abort(RemoteProtocolError(f"request without a call id from {link.peer.name!r}"))
            return
        call = IncomingCall(link, call_id, str(frame.meta.get("f", "?")))
        waits: list[asyncio.Future[Any]] = []
        try:
            func, args, kwargs = loads_request(
                self._agent, link.peer.rank, frame.payload, frame.buffers, waits=waits
            )
        except Exception as exc:
            self._reply_error(
                call,
                SerializationError(
                    f"worker {self.worker!r} cannot run {call.function}: {exc}",
                    worker=self.worker,
                    function=call.function,
                ),
            )
            return
        context = self._context.copy()
        apply_carried(context, frame.meta.get("c"))
        if waits:
            self._start_after(waits, call, lambda: self._start(call, context, func, args, kwargs))
        else:
            self._start(call, context, func, args, kwargs)
        self._apply_backpressure(link)

    def on_cancel(self, link: Link, frame: Frame) -> None:
        """The caller gave up: stop the work, and send nothing (nobody waits for it)."""
        calls = self._links.get(link)
        if calls is None or calls.running.get(frame.meta.get("i", -1)) is None:
            return  # finished already, or in a pool thread (cannot be interrupted)
        future = calls.running.pop(frame.meta["i"])
        assert future is not None
        self._apply_backpressure(link)
        future.cancel()

    # -- running -------------------------------------------------------------------

    def _start_after(
        self, waits: list[asyncio.Future[Any]], call: IncomingCall, start: Callable[[], None]
    ) -> None:
        """``start()`` ``call`` once every future in ``waits`` is done (whatever its
        outcome: a value that failed to be made raises in the call itself)."""
        self._links[call.link].running[call.call_id] = None  # counted; not cancellable yet

        def ready(_: asyncio.Future[Any]) -> None:
            calls = self._links.get(call.link)  # (gone with its link: nobody waits)
            if calls is not None and calls.running.pop(call.call_id, False) is None:
                start()

        asyncio.gather(*waits, return_exceptions=True).add_done_callback(ready)

    def _start(
        self,
        call: IncomingCall,
        context: contextvars.Context,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Run ``func`` for ``call`` in ``context`` (a copy of the agent's, for this call)."""
        running = self._links[call.link].running
        placement = describe(func)[0]
        if placement is Placement.THREAD:
            running[call.call_id] = None
            slow = self._took.get(call.function, SPIN_BELOW) >= SPIN_BELOW
            self.slow_threads_busy += slow
            job = lambda: func(*args, **kwargs)  # noqa: E731
            self._pool.submit(context.run, self._run_in_thread, call, job, slow)
            return
        try:
            if placement is Placement.INLINE:  # the reply is pickled in the call's context too
                context.run(self._send_inline_result, call, func, args, kwargs)
                return
            handler = self._call_on_loop(placement, context, func, args, kwargs)
            if isinstance(handler, Coroutine):
                running[call.call_id] = self._loop.create_task(
                    self._serve(call, handler), context=context
                )
                return
            future = self._as_future(handler, call.function)
        except BaseException as exc:
            self._reply_error(call, exc)
            return
        running[call.call_id] = future
        if future.done():  # finished on the spot (a quick step, say): reply in this turn
            context.run(self._reply_future, call, future)
        else:
            future.add_done_callback(lambda f: self._reply_future(call, f), context=context)

    def _send_inline_result(
        self,
        call: IncomingCall,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._send_result(call, func(*args, **kwargs))

    def invoke(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> asyncio.Future[Any]:
        """Run ``func`` where its placement says (as an incoming call would run, with
        the propagated variables of the caller's context: its distributed autograd
        context, say); returns a future, on the loop, of its result."""
        placement, name = describe(func)
        context = self._context.copy()
        apply_carried(context, carried())
        if placement is Placement.THREAD:
            future = self._loop.create_future()
            self.slow_threads_busy += 1
            self._pool.submit(context.run, self._invoke_in_thread, future, func, args, kwargs)
            return future
        try:
            if placement is Placement.INLINE:
                done = self._loop.create_future()
                done.set_result(context.run(func, *args, **kwargs))
                return done
            handler = self._call_on_loop(placement, context, func, args, kwargs)
            if isinstance(handler, Coroutine):
                return self._loop.create_task(_contained(handler), context=context)
            return self._as_future(handler, name)
        except Exception as exc:
            failed = self._loop.create_future()
            failed.set_exception(exc)
            return failed

    def offload(self, kind: Hashable, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Framework compute ``func(*args)``: on the loop at once if the last job of
        ``kind`` took under ``INLINE_BELOW`` seconds, else in the pool; a future of it."""
        if self._took.get(kind, INLINE_BELOW) >= INLINE_BELOW:
            return self.invoke(self._timed, (kind, func, *args), {})
        done = self._loop.create_future()
        try:
            done.set_result(self._timed(kind, func, *args))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def _timed(self, kind: Hashable, func: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return func(*args)
        finally:
            self._learn(kind, time.perf_counter() - started)

    def _learn(self, kind: Hashable, seconds: float) -> None:
        if len(self._took) >= _KINDS_KEPT:
            self._took.clear()
        self._took[kind] = seconds

    @staticmethod
    def _call_on_loop(
        placement: Placement,
        context: contextvars.Context,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """LOOP: the coroutine itself; AWAITABLE: whatever the function returns."""
        if placement is Placement.LOOP:
            return func(*args, **kwargs)
        return context.run(func, *args, **kwargs)

    def _invoke_in_thread(
        self,
        future: asyncio.Future[Any],
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        try:
            outcome: tuple[bool, Any] = (True, func(*args, **kwargs))
        except BaseException as exc:
            outcome = (False, as_exception(exc))
        with contextlib.suppress(RuntimeError):  # loop closed: the agent has shut down
            self._loop.call_soon_threadsafe(self._settle, future, *outcome)

    def _settle(self, future: asyncio.Future[Any], ok: bool, value: Any) -> None:
        self.slow_threads_busy -= 1
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    async def _serve(self, call: IncomingCall, handler: Coroutine[Any, Any, Any]) -> None:
        """Run an ``async def`` call and reply in the same step it finishes (a done
        callback would cost the reply one more loop turn)."""
        try:
            result = await handler
        except asyncio.CancelledError:
            if self._retire(call):  # cancelled by the callee's own code: say so
                self._reply_cancelled(call)
            raise
        except BaseException as exc:  # SystemExit too: it ends this call, not the worker
            if self._retire(call):
                self._reply_error(call, exc)
            return
        if self._retire(call):
            self._send_result(call, result)

    def _run_in_thread(self, call: IncomingCall, run: Callable[[], Any], slow: bool) -> None:
        """In a pool thread: run the function and encode its reply right here."""
        started = time.perf_counter()
        reply: Outgoing | None = None
        try:
            reply = self._reply_of(call, run())
            outcome: tuple[bool, Any] = (True, reply.encode_for(call.link))
        except BaseException as exc:  # (a reply that failed to encode is abandoned)
            outcome = (False, exc)
        self._learn(call.function, time.perf_counter() - started)
        self._completions.append((call, *outcome, reply, slow))
        with self._lock:
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        with contextlib.suppress(RuntimeError):  # loop closed: the agent has shut down
            self._loop.call_soon_threadsafe(self._drain_completions)

    def _drain_completions(self) -> None:
        """On the loop: send every queued pool-thread reply (one wake-up per batch)."""
        with self._lock:
            self._drain_scheduled = False
        while self._completions:
            call, ok, value, reply, slow = self._completions.popleft()
            self.slow_threads_busy -= slow
            if not self._retire(call):
                if reply is not None:
                    reply.abandon()  # nobody awaits it
                continue
            if ok and reply is not None:
                call.link.write(value)
                reply.sent()
            else:
                self._reply_error(call, value)

    def _as_future(self, awaitable: Any, function: str) -> asyncio.Future[Any]:
        if isinstance(awaitable, torch._C.Future):  # also what Future.then() returns
            future = self._loop.create_future()

            def done(source: torch._C.Future[Any]) -> None:
                self._loop.call_soon_threadsafe(_copy_torch_future, source, future)

            awaitable.add_done_callback(done)
            return future
        if asyncio.isfuture(awaitable):
            # Callers often share one future (a batch): cancelling this call's view of
            # it (its caller timed out) must not cancel it for the others.
            return asyncio.shield(awaitable)
        raise TypeError(
            f"async_execution function {function} returned "
            f"{type(awaitable).__name__}, not an awaitable "
            "(asyncio future, coroutine or torch.futures.Future)"
        )

    # -- replies -------------------------------------------------------------------

    def _reply_future(self, call: IncomingCall, future: asyncio.Future[Any]) -> None:
        if not self._retire(call):
            return
        if future.cancelled():  # by the callee's own code: the caller still waits
            self._reply_cancelled(call)
            return
        error = future.exception()
        if error is not None:
            self._reply_error(call, error)
            return
        self._send_result(call, future.result())

    def _send_result(self, call: IncomingCall, result: Any) -> None:
        try:
            self._reply_of(call, result).send_on(call.link)
        except Exception as exc:  # (a reply the link refused is abandoned)
            self._reply_error(call, exc)

    def _reply_of(self, call: IncomingCall, result: Any) -> Outgoing:
        """``result`` serialised as ``call``'s RESPONSE."""
        return dumps_reply(
            self._agent, call.link.peer.rank, result, call_id=call.call_id, function=call.function
        )

    def _reply_cancelled(self, call: IncomingCall) -> None:
        self._reply_error(
            call, RemoteError(f"{call.function} was cancelled on worker {self.worker!r}")
        )

    def _reply_error(self, call: IncomingCall, exc: BaseException) -> None:
        """Send ``exc`` as the call's ERROR reply.  An error too large for the caller is
        replaced by the LocalProtocolError saying so; if even that is too large (a
        limit of a few hundred bytes), nothing is sent and the caller times out."""
        self._log_failure(call, exc)
        if call.link.closed:
            return
        try:
            self._send_error(call, exc)
        except LocalProtocolError as too_large:
            try:
                self._send_error(call, too_large)
            except LocalProtocolError:
                log.warning("no reply of %s fits %r: %s", call.function, call.link, too_large)

    def _log_failure(self, call: IncomingCall, exc: BaseException) -> None:
        """Record a failed call on the callee (the caller gets the error itself)."""
        if calls_log.isEnabledFor(logging.INFO):
            calls_log.info(
                "worker %r: %s, called by %r, failed: %r",
                self.worker,
                call.function,
                call.link.peer.name,
                exc,
                exc_info=exc,
            )

    def _send_error(self, call: IncomingCall, exc: BaseException) -> None:
        payload, buffers = pack_error(exc, self.worker, call.function)
        call.link.send(Kind.ERROR, {"i": call.call_id}, payload, buffers, function=call.function)

    def _retire(self, call: IncomingCall) -> bool:
        """Forget a finished call; False if nobody awaits its reply any more (its link is
        gone, or its caller cancelled it)."""
        calls = self._links.get(call.link)
        if calls is None or call.call_id not in calls.running:
            return False
        del calls.running[call.call_id]
        self._apply_backpressure(call.link)
        return not call.link.closed

    def _apply_backpressure(self, link: Link) -> None:
        calls = self._links[link]
        if not calls.paused and len(calls.running) >= self.max_running:
            calls.paused = True
            link.pause_reading()
        elif calls.paused and len(calls.running) <= self.max_running // 2:
            calls.paused = False
            link.resume_reading()


async def _contained(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coroutine``; a KeyboardInterrupt or SystemExit it raises fails its future
    instead of escaping the task and stopping the worker's loop."""
    try:
        return await coroutine
    except (KeyboardInterrupt, SystemExit) as exc:
        raise as_exception(exc) from exc


def _copy_torch_future(source: torch._C.Future[Any], target: asyncio.Future[Any]) -> None:
    if target.done():
        return
    try:
        target.set_result(source.value())
    except BaseException as exc:
        target.set_exception(exc)
