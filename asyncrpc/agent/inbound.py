"""The serving side of an agent: incoming calls, from request frame to reply frame.

Theory of operation
-------------------
Each request becomes an :class:`IncomingCall` (its link, call id and function
name) and runs, in a copy of the agent's context with the variables its request
carried, where :func:`~asyncrpc.agent.dispatch.describe` places it: the
:class:`~asyncrpc.agent.runner.Runner` runs it and reports its outcome to the
call itself, which is its own completion and replies.  A THREAD call's job is
its function *and* the serialisation of its result (with the copy of large
buffers into shared memory, within the worker's budget), both in the pool
thread: its outcome is an :class:`EncodedReply`, which the completion writes.
A plain result (``serde.is_plain``: ``None``, a number, a few of them) is the
exception: its pickle takes a microsecond or two, less than the pool thread's
extra time holding the GIL costs the loop, which waits for it (pipelined no-ops
in-process: 47 µs a call pickled in the pool, 36 on the loop), so it goes back
as it is.
The result of a call run on the loop, or a plain one, is serialised in the
completion (a plain one, marked plain, straight onto the link: it has nothing to
undo or stage), and ``Link.send`` has large buffers copied into shared memory off
the loop.

:meth:`Inbound.invoke` runs a function by the same placement rules, through the
same runner, for upper layers (an RRef's value is made this way); its
completion resolves a future instead of replying.
:meth:`Inbound.offload` is for the framework's own compute (a backward piece, an
optimizer step), which a training loop runs again and again at the same size:
it learns how long each *kind* of job takes, and runs a kind that last took
under ``INLINE_BELOW`` on the loop, where a small job costs less than the trip
through a pool thread; a new kind, or a slow one, goes to the pool.  (Never for
user functions: one of those may block on the loop it would be running on.)

Every call ends in exactly one RESPONSE or ERROR frame, unless its link is
gone (then nobody is waiting), and is counted once in the worker's
:class:`~asyncrpc.agent.metrics.CallMetrics`: its outcome (``ok``, ``error``,
``cancelled`` when nobody waits any more), the seconds from its request's
arrival to its reply, and of those, how long it waited to start (for a pool
call, until a thread took it); while a torch profiler runs, those moments
also bound its spans (:mod:`asyncrpc.agent.spans`).  A reply larger than the
caller accepts (its ``max_frame_size``, announced in the handshake) is not
sent: the call's ERROR reply is the ``LocalProtocolError`` that says so, and
the link stays up.  A
CANCEL from the caller (its deadline passed) cancels a task or awaitable; a
pool thread cannot be interrupted, and its late result is dropped.  Per link,
more than ``max_running`` calls in flight pause reading until half of them
have finished.

``Inbound`` knows nothing of the agent: it gets the worker's name and the
functions that (de)serialise the agent's messages (see
:mod:`asyncrpc.agent.transfer`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from asyncrpc.agent.dispatch import Placement, as_exception, describe, pack_error
from asyncrpc.agent.metrics import CallMetrics
from asyncrpc.agent.outgoing import Outgoing
from asyncrpc.agent.runner import Runner, cancel_call
from asyncrpc.agent.spans import ServedSpan, profiling
from asyncrpc.agent.transfer import BY_NAME, PLAIN, TENSORS, apply_carried, carried
from asyncrpc.errors import (
    LocalProtocolError,
    RemoteError,
    RemoteProtocolError,
    SerializationError,
)
from asyncrpc.serde import dumps_plain, is_plain
from asyncrpc.serde.references import resolve
from asyncrpc.transport import Link
from asyncrpc.transport.flow import Parts
from asyncrpc.wire import Frame, Kind
from asyncrpc.wire.messages import RESPONSE

log = logging.getLogger("asyncrpc.agent")
calls_log = logging.getLogger("asyncrpc.agent.calls")  # failed calls, on the callee (INFO)

# Seconds: framework compute that last took less runs on the loop (see Inbound.offload).
INLINE_BELOW = 1e-3


class LoadsRequest(Protocol):
    """A request's ``(func, args, kwargs)`` (``plain``: its header says ``PLAIN``;
    ``tensors``: its ``TENSORS``); futures the call must not start before are added to
    ``waits``."""

    def __call__(
        self,
        peer_rank: int,
        payload: bytes | bytearray,
        buffers: Sequence[Any],
        *,
        plain: bool,
        waits: list[asyncio.Future[Any]],
        tensors: Any = None,
    ) -> Any: ...


class DumpsReply(Protocol):
    """``result`` serialised as the RESPONSE of call ``call_id`` (of ``function``)."""

    def __call__(self, peer_rank: int, result: Any, *, call_id: int, function: str) -> Outgoing: ...


@dataclass(slots=True)  # (not frozen: that makes one several times slower to make)
class IncomingCall:
    """A request being served.  It is its own completion: ``call(ok, value)`` replies."""

    inbound: Inbound
    link: Link
    call_id: int
    function: str
    arrived: float  # perf_counter() when its request was handed up
    started: float = 0.0  # when its function was called (0: not yet)
    span: ServedSpan | None = None  # its spans in a torch.profiler trace, while one runs

    def __call__(self, ok: bool, value: Any) -> None:
        self.inbound._reply(self, ok, value)


@dataclass(slots=True)
class EncodedReply:
    """The result of a call run in a pool thread, encoded there as its RESPONSE: the
    reply, to be marked sent or abandoned."""

    parts: Parts
    reply: Outgoing


@dataclass(slots=True)
class _LinkCalls:
    running: dict[int, asyncio.Future[Any] | None] = field(default_factory=dict)
    paused: bool = False


class Inbound:
    """Runs the calls that arrive on a worker's accepted links."""

    def __init__(
        self,
        worker: str,
        context: contextvars.Context,
        threads: int,
        max_running: int,
        *,
        loads_request: LoadsRequest,
        dumps_reply: DumpsReply,
        metrics: CallMetrics,
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        self.max_running = max_running
        self._context = context
        self._loads_request = loads_request
        self._dumps_reply = dumps_reply
        self._loop = asyncio.get_running_loop()
        self._runner = Runner(threads, f"asyncrpc-{worker}")
        self._links: dict[Link, _LinkCalls] = {}
        self._staging: set[asyncio.Task[Any]] = set()  # replies waiting for CUDA copies

    @property
    def pool_stats(self) -> dict[str, int]:
        """The thread pool's threads, busy ones and queued jobs."""
        return self._runner.pool_stats

    @property
    def slow_threads_busy(self) -> int:
        """Pool calls (incoming or invoked) not proven quick, not yet completed."""
        return self._runner.slow_threads_busy

    # -- links ---------------------------------------------------------------------

    def add_link(self, link: Link) -> None:
        self._links[link] = _LinkCalls()

    def drop_link(self, link: Link) -> None:
        """Forget a lost link and cancel what runs for it."""
        calls = self._links.pop(link, None)
        for future in calls.running.values() if calls else ():
            if future is not None:
                cancel_call(future)

    def link_from(self, name: str) -> Link | None:
        """An open link worker ``name`` dialed to us, if any."""
        return next((link for link in self._links if link.peer.name == name), None)

    @property
    def links(self) -> list[Link]:
        return list(self._links)

    @property
    def peers(self) -> set[str]:
        """The workers whose links to us are open (not closing)."""
        return {link.peer.name for link in self._links if not link.closing}

    @property
    def running(self) -> int:
        return sum(len(calls.running) for calls in self._links.values())

    def close(self) -> None:
        for task in self._staging:
            task.cancel()
        for link in list(self._links):
            self.drop_link(link)
            link.close()
        self._runner.close()

    # -- frames --------------------------------------------------------------------

    def on_request(self, link: Link, frame: Frame) -> None:
        if link not in self._links:  # dropped while requests were still queued on it:
            return  # nothing runs for it any more, and its caller's calls fail with it
        meta = frame.meta
        call_id = meta.get("i")
        if type(call_id) is not int:
            link.abort(RemoteProtocolError(f"request without a call id from {link.peer.name!r}"))
            return
        call = IncomingCall(self, link, call_id, str(meta.get("f", "?")), time.perf_counter())
        if profiling():
            call.span = ServedSpan(call.function, link.peer.name, call_id)
        waits: list[asyncio.Future[Any]] = []
        by_name = meta.get(BY_NAME)
        try:
            func = None if by_name is None else resolve(by_name)
            value = self._loads_request(
                link.peer.rank,
                frame.payload,
                frame.buffers,
                plain=PLAIN in meta,
                waits=waits,
                tensors=meta.get(TENSORS),
            )
            if func is None:
                func, args, kwargs = value
            else:
                args, kwargs = value
        except Exception as exc:
            self._count(call, "error")
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
        apply_carried(context, meta.get("c"))
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
        cancel_call(future)

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
        """Run ``func`` for ``call`` in ``context`` (a copy of the agent's, for this call);
        its completion replies."""
        running = self._links[call.link].running
        running[call.call_id] = None  # counted from now on: it may complete at once
        call.started = time.perf_counter()
        placement = describe(func)[0]
        if placement is Placement.THREAD:  # the reply is encoded in the pool thread too
            func, args, kwargs = self._run_and_encode, (call, func, args, kwargs), {}
        if call.span is not None:
            call.span.placed(placement is Placement.THREAD)
        cancel = self._runner.run(
            placement, func, args, kwargs, name=call.function, context=context, done=call
        )
        if cancel is not None and call.call_id in running:
            running[call.call_id] = cancel  # a CANCEL from the caller cancels it

    def invoke(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> asyncio.Future[Any]:
        """Run ``func`` where its placement says (as an incoming call would run, with
        the propagated variables of the caller's context: its distributed autograd
        context, say); returns a future, on the loop, of its result.  Cancelling the
        future cancels the call where it can be (a task or awaitable)."""
        placement, name = describe(func)
        return self._invoke(placement, name, func, args, kwargs)

    def offload(self, kind: Hashable, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Framework compute ``func(*args)``: on the loop at once if the last job of
        ``kind`` took under ``INLINE_BELOW`` seconds, else in the pool; a future of it."""
        took = self._runner.took(kind)
        if took is None or took >= INLINE_BELOW:  # the pool learns its time under kind
            return self._invoke(Placement.THREAD, kind, func, args, {})
        done = self._loop.create_future()
        try:
            done.set_result(self._timed(kind, func, *args))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def _invoke(
        self,
        placement: Placement,
        name: Hashable,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> asyncio.Future[Any]:
        context = self._context.copy()
        apply_carried(context, carried())
        future = self._loop.create_future()
        cancel = self._runner.run(
            placement,
            func,
            args,
            kwargs,
            name=name,
            context=context,
            done=partial(_resolve, future),
        )
        if cancel is not None and not future.done():
            future.add_done_callback(partial(_cancel_with, cancel))
        return future

    def _timed(self, kind: Hashable, func: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return func(*args)
        finally:
            self._runner.learn(kind, time.perf_counter() - started)

    # -- replies -------------------------------------------------------------------

    def _run_and_encode(
        self,
        call: IncomingCall,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """In a pool thread: a THREAD call's job, its function and its reply's encoding
        (an EncodedReply), or its result as it is if plain (see the module docstring)."""
        call.started = time.perf_counter()  # its wait for a pool thread was queueing too
        if call.span is not None:
            call.span.taken()
        result = func(*args, **kwargs)
        if is_plain(result):
            return result
        reply = self._reply_of(call, result)
        try:
            reply.wait_staged_here()  # (its CUDA copies: this is a pool thread)
        except BaseException:
            reply.abandon()
            raise
        return EncodedReply(reply.encode_for(call.link), reply)  # (abandoned if refused)

    def _reply(self, call: IncomingCall, ok: bool, value: Any) -> None:
        """Every call's completion: ``value`` is its result (an EncodedReply if it ran in
        a pool thread), or what it raised."""
        if not self._retire(call):
            self._count(call, "cancelled")
            if ok and type(value) is EncodedReply:
                value.reply.abandon()  # nobody awaits it
            return
        if call.span is not None:  # before the reply leaves: then, in a trace, the run
            call.span.ended()  # lies within the caller's span, however the CPUs are shared
        if not ok:
            self._reply_failure(call, value)
        elif type(value) is EncodedReply:
            call.link.write(value.parts)
            value.reply.sent()
        else:
            self._send_result(call, value)
        self._count(call, "ok" if ok else "error")  # (while the reply travels)

    def _count(self, call: IncomingCall, outcome: str) -> None:
        now = time.perf_counter()
        started = call.started or now
        if call.span is not None:
            call.span.ended()
        self.metrics.served(call.function, outcome, now - call.arrived, started - call.arrived)

    def _send_result(self, call: IncomingCall, result: Any) -> None:
        try:
            payload = self._plain_reply(call, result)
            if payload is not None:  # nothing to undo or stage: written as it is
                meta = {"i": call.call_id, PLAIN: True}
                call.link.send(RESPONSE, meta, payload, function=call.function)
                return
            reply = self._reply_of(call, result)
            if not reply.ready:  # CUDA copies still running: send it once they are done
                self._staging.add(self._loop.create_task(self._send_when_staged(call, reply)))
                return
            reply.send_on(call.link)
        except Exception as exc:  # (a reply the link refused is abandoned)
            self._reply_error(call, exc)

    async def _send_when_staged(self, call: IncomingCall, reply: Outgoing) -> None:
        try:
            await reply.wait_staged()
            reply.send_on(call.link)
        except Exception as exc:
            reply.abandon()
            self._reply_error(call, exc)
        finally:
            self._staging.discard(asyncio.current_task())

    def _reply_of(self, call: IncomingCall, result: Any) -> Outgoing:
        """``result`` serialised as ``call``'s RESPONSE; a SerializationError names the
        worker and the function whose result it could not serialise."""
        try:
            return self._dumps_reply(
                call.link.peer.rank, result, call_id=call.call_id, function=call.function
            )
        except SerializationError as exc:
            raise self._unsendable(call, exc) from exc

    def _plain_reply(self, call: IncomingCall, result: Any) -> bytes | None:
        """The payload of ``result`` if plain (``serde.dumps_plain``), else None."""
        try:
            return dumps_plain(result)
        except SerializationError as exc:
            raise self._unsendable(call, exc) from exc

    def _unsendable(self, call: IncomingCall, exc: SerializationError) -> SerializationError:
        return SerializationError(
            f"worker {self.worker!r} cannot send the result of {call.function}: {exc}",
            worker=self.worker,
            function=call.function,
        )

    def _reply_failure(self, call: IncomingCall, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):  # by the callee's own code
            exc = RemoteError(f"{call.function} was cancelled on worker {self.worker!r}")
        self._reply_error(call, exc)

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
        if calls.paused:  # one fewer running: perhaps few enough to read again
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


def _resolve(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    """An invoked call's completion."""
    if future.done():  # cancelled by whoever waited for it
        return
    if ok:
        future.set_result(value)
    elif isinstance(value, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(as_exception(value))


def _cancel_with(cancel: asyncio.Future[Any], future: asyncio.Future[Any]) -> None:
    if future.cancelled():
        cancel_call(cancel)
