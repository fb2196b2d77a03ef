"""RRef handles: ``remote()``, ``RRef(value)``, ``to_here()`` and method proxies.

Theory of operation
-------------------
An :class:`RRef` is a thin Python handle: the RRef's id, its owner's rank and
the worker's :class:`~asyncrpc.rref.context.RRefContext`.  Every handle is
counted by the state machine when it is made and uncounted when it dies, so
the owner's value lives exactly as long as some handle (or a fork in flight)
exists somewhere.

On the wire a handle pickles (through the agent's transfer context) to
``(id, owner, fork, sender)``; unpickling it on the receiver attaches a new
handle to that worker's context.  ``remote()`` sends one request to the owner,
which records the RRef before running the function by the usual placement
rules; ``to_here()`` and method calls that follow on the same link are
answered once the value exists.  A method call sends a :class:`_MethodCall`
that unpickles, on the owner, to the bound method itself, so it runs where any
function would (loop, awaitable or thread pool) with no extra hop.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from asyncrpc.agent import (
    RpcAgent,
    WorkerInfo,
    async_execution,
    current_agent,
    current_transfer,
    start_after,
)
from asyncrpc.agent.dispatch import function_name
from asyncrpc.agent.runner import mark_retrieved
from asyncrpc.errors import (
    AgentStateError,
    AsyncRPCError,
    PeerLostError,
    RPCTimeoutError,
    RRefError,
    SerializationError,
)
from asyncrpc.rref.context import RRefContext, context_for
from asyncrpc.rref.protocol import ForkId, RRefId
from asyncrpc.serde import register_plain, register_reducer

T = TypeVar("T")
Target = str | int | WorkerInfo


class RRef(Generic[T]):
    """A reference to a value that lives on its owner worker.

    ``RRef(value)`` wraps a local value (this worker owns it) so it can be sent to
    others; :func:`remote` makes one whose value is built on another worker.
    """

    __slots__ = ("__weakref__", "_context", "_creation", "_id", "_owner")

    _context: RRefContext
    _id: RRefId
    _owner: int
    _creation: asyncio.Future[Any] | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_reducer(cls, _reduce_rref)  # a subclass's handles travel as RRefs too

    def __init__(self, value: T) -> None:
        context = context_for(_agent())
        done = context.agent.loop.create_future()
        done.set_result(value)
        self._context = context
        self._id = context.create_local(done)
        self._owner = context.rank
        self._creation = None

    @classmethod
    def _attach(
        cls,
        context: RRefContext,
        rref: RRefId,
        owner: int,
        creation: asyncio.Future[Any] | None = None,
    ) -> RRef[Any]:
        """A handle for an RRef the state machine has just counted one more handle of."""
        handle: RRef[Any] = cls.__new__(cls)
        handle._context, handle._id, handle._owner = context, rref, owner
        handle._creation = creation
        return handle

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # A handle still held as the interpreter exits (the worker left without shutdown)
        # dies with modules half torn down: nothing to count then (its owner learns of
        # the loss from the link).  ``_finalizing`` is bound here for that hour.
        context = getattr(self, "_context", None)
        if context is not None and not context.closed and not _finalizing():
            context.dropped(self._id)

    def __copy__(self) -> RRef[T]:
        return self  # a handle is an immutable reference: copies are the same handle

    def __deepcopy__(self, memo: dict[int, Any]) -> RRef[T]:
        return self

    def __reduce__(self) -> Any:
        raise SerializationError(
            f"{self!r} can only be pickled into asyncrpc calls (arguments or results)"
        )

    def __repr__(self) -> str:
        return f"RRef(owner={self.owner_name()!r}, id={self._id})"

    # -- where it lives ------------------------------------------------------------

    def owner(self) -> WorkerInfo:
        """The worker that holds the value."""
        return self._context.agent.resolve(self._owner).info

    def owner_name(self) -> str:
        """The name of the worker that holds the value."""
        return self.owner().name

    def is_owner(self) -> bool:
        """True on the worker that holds the value."""
        return self._owner == self._context.rank

    def confirmed_by_owner(self) -> bool:
        """True once the owner counts this worker's reference (always, on the owner)."""
        if self.is_owner():
            return True
        held = self._context.state.held.get(self._id)
        return held is not None and held.confirmed

    # -- the value -----------------------------------------------------------------

    def local_value(self) -> T:
        """The value itself; only on the owner, once it has been made."""
        if not self.is_owner():
            raise RRefError(
                f"local_value() of {self!r} called on worker {self._context.agent.info.name!r}, "
                "which is not its owner; use `await rref.to_here()`"
            )
        future = self._context.value_of(self._id)
        if not future.done():
            raise RRefError(f"the value of {self!r} is not made yet; `await rref.to_here()`")
        return future.result()  # type: ignore[no-any-return]

    async def to_here(self, timeout: float | None = None) -> T:
        """A copy of the value (the value itself on the owner).  An error raised while
        making it, or a timeout of ``remote()``, is raised here."""
        if self.is_owner():
            return await self._local_value_within(timeout)
        self._raise_creation_error()
        value = self._context.agent.rpc_async(
            self._owner, _fetch, (self._id,), timeout=timeout, label="RRef.to_here"
        )
        return await self._unless_creation_fails(value)  # type: ignore[no-any-return]

    async def _local_value_within(self, timeout: float | None) -> T:
        future = self._context.value_of(self._id)
        timeout = self._context.agent.options.timeout_for(timeout)
        if not timeout or future.done():
            return await future  # type: ignore[no-any-return]
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise RPCTimeoutError(
                f"the value of {self!r} was not made within {timeout}s",
                worker=self._context.agent.info.name,
            ) from None

    def _released_error(self) -> AsyncRPCError:
        """Why this worker no longer holds a reference it could pass on."""
        owner = self._context.agent.resolve(self._owner).name
        if self._owner in self._context.state.lost:
            return PeerLostError(f"the owner {owner!r} of {self!r} died", worker=owner)
        return RRefError(f"{self!r} was released (shutdown, or its value was freed)")

    def _unless_creation_fails(self, call: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """``call``'s outcome, or the error of ``remote()`` if that comes first."""
        creation = self._creation
        if creation is None or creation.done():
            return call
        first: asyncio.Future[Any] = call.get_loop().create_future()

        def copy(done: asyncio.Future[Any]) -> None:
            if first.done():
                return
            if done is call:
                _copy_outcome(call, first)
            elif not done.cancelled() and done.exception() is not None:
                first.set_exception(done.exception())  # type: ignore[arg-type]
                call.remove_done_callback(copy)  # a late reply must not keep `first` alive
                call.add_done_callback(mark_retrieved)  # nor its error be logged as unseen

        call.add_done_callback(copy)
        creation.add_done_callback(copy)
        return first

    def _raise_creation_error(self) -> None:
        creation = self._creation
        if creation is not None and creation.done() and not creation.cancelled():
            error = creation.exception()
            if error is not None:
                raise error

    async def backward(self, context_id: int, retain_graph: bool = False) -> None:
        """Distributed backward pass from this RRef's scalar value, run on its owner
        in autograd context ``context_id`` (see :mod:`asyncrpc.autograd`)."""
        if _backward is None:
            raise AgentStateError("distributed autograd is not loaded (import asyncrpc)")
        if self.is_owner():
            await _backward(self, context_id)
            return
        await self._context.agent.rpc_async(
            self._owner, _backward, (self, context_id), label="RRef.backward"
        )

    # -- proxies -------------------------------------------------------------------

    def rpc_async(self, timeout: float | None = None) -> Any:
        """``rref.rpc_async().method(*a, **kw)`` runs ``method`` on the owner; a future."""
        return _Proxy(self, "rpc_async", timeout)

    def rpc_sync(self, timeout: float | None = None) -> Any:
        """``rref.rpc_sync().method(*a, **kw)``: the blocking form, for other threads."""
        return _Proxy(self, "rpc_sync", timeout)

    def remote(self, timeout: float | None = None) -> Any:
        """``rref.remote().method(*a, **kw)``: an RRef, on the owner, of the result."""
        return _Proxy(self, "remote", timeout)

    def _call(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> asyncio.Future[Any]:
        try:
            self._raise_creation_error()
        except BaseException as exc:  # a proxy call fails through its future
            failed: asyncio.Future[Any] = self._context.agent.loop.create_future()
            failed.set_exception(exc)
            return failed
        if self.is_owner():
            return _call_when_made(self._context, self._id, method, args, kwargs)
        call = _MethodCall(self, method)
        sent = self._context.agent.rpc_async(self._owner, call, args, kwargs, timeout)
        return self._unless_creation_fails(sent)


_backward: Callable[[RRef[Any], int], Awaitable[None]] | None = None


def set_backward(backward: Callable[[RRef[Any], int], Awaitable[None]]) -> None:
    """Distributed autograd registers what ``RRef.backward`` runs on the owner."""
    global _backward
    _backward = backward


class _Proxy:
    """What ``rref.rpc_async()`` and friends return: attribute access picks the method."""

    __slots__ = ("_kind", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], kind: str, timeout: float | None) -> None:
        self._rref, self._kind, self._timeout = rref, kind, timeout

    def __getattr__(self, method: str) -> Any:
        rref, kind, timeout = self._rref, self._kind, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            if kind == "rpc_async":
                return rref._call(method, args, kwargs, timeout)
            if kind == "remote":
                return remote(rref._owner, _MethodCall(rref, method), args, kwargs, timeout)
            agent = rref._context.agent
            limit = agent.options.timeout_for(timeout)
            return agent.run_blocking(
                lambda: rref._call(method, args, kwargs, timeout), limit, f"{rref!r}.{method}"
            )

        call.__name__ = method
        return call


class _MethodCall:
    """``getattr(rref_value, method)`` as a callable sent to the owner; it unpickles
    there to the bound method (see :func:`_owner_method`)."""

    __slots__ = ("method", "rpc_name", "rref")

    def __init__(self, rref: RRef[Any], method: str) -> None:
        self.rref, self.method = rref, method
        self.rpc_name = f"RRef.{method}"  # one metric series per method, not per RRef

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.rref.is_owner():
            raise RRefError(f"{self.rpc_name} can only run on the owner of the RRef")
        value = self.rref.local_value()
        return getattr(value, self.method)(*args, **kwargs)


def _reduce_method_call(call: _MethodCall) -> Any:
    transfer = current_transfer()
    if transfer is None or transfer.peer_rank != call.rref._owner:
        raise SerializationError(f"{call.rpc_name} can only be sent to the RRef's owner")
    return _owner_method, (call.rref._id, call.method)


def _owner_method(rref: RRefId, method: str) -> Any:
    """On the owner: the bound method, or a stand-in that waits for the value first."""
    context = _receiving_context()
    future = context.value_of(rref)
    if _made(future) and hasattr(future.result(), method):
        return getattr(future.result(), method)
    return _WhenMade(context, rref, method)  # it waits, or raises when called


def _made(value: asyncio.Future[Any]) -> bool:
    return value.done() and not value.cancelled() and value.exception() is None


class _WhenMade:
    """Runs a method once the RRef's value exists (or raises why it never will)."""

    _asyncrpc_async_execution = True  # placed as an awaitable: no thread waits

    def __init__(self, context: RRefContext, rref: RRefId, method: str) -> None:
        self.context, self.rref, self.method = context, rref, method

    def __call__(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        return _call_when_made(self.context, self.rref, self.method, args, kwargs)


def _call_when_made(
    context: RRefContext, rref: RRefId, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> asyncio.Future[Any]:
    """Owner: call ``value.method(*args, **kwargs)`` by its placement once the value exists."""
    value = context.value_of(rref)
    if _made(value):
        return context.agent.invoke(getattr(value.result(), method), args, kwargs)

    async def later() -> Any:
        made = await asyncio.shield(value)
        return await context.agent.invoke(getattr(made, method), args, kwargs)

    return asyncio.ensure_future(later())


# -- remote() and the owner's handlers --------------------------------------------------


def remote(
    to: Target,
    func: Any,
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> RRef[Any]:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and keep the result there.

    Returns an RRef at once, without waiting for a round trip.  An error raised by
    ``func``, or a timeout (``timeout`` seconds, default ``rpc_timeout``), is raised
    by the first use of the RRef.  Call it on the event loop thread.
    """
    agent = _agent()
    context = context_for(agent)
    owner = agent.resolve(to).rank
    # Handles dropped since the loop last counted them (the previous one of a loop that
    # makes and drops RRefs, say) are counted now: their deletions ride on this request.
    context.count_dropped()
    if owner == context.rank:
        made = (
            _call_when_made(context, func.rref._id, func.method, args or (), kwargs or {})
            if isinstance(func, _MethodCall)
            else agent.invoke(func, args or (), kwargs or {})
        )
        return _handle_type(context)._attach(context, context.create_local(made), owner)
    with context._lock:
        rref, fork = context.state.create_remote(owner)
    try:
        creation = agent.rpc_async(
            owner,
            _create,
            (_Registration(rref, fork), func, args or (), kwargs or {}),
            timeout=timeout,
            label=f"remote({function_name(func)})",
        )
    except BaseException:
        with context._lock:
            del context.state.held[rref]  # nothing was sent, and no handle exists
        raise
    creation.add_done_callback(lambda done: _created(context, rref, done))
    return _handle_type(context)._attach(context, rref, owner, creation)


def _created(context: RRefContext, rref: RRefId, creation: asyncio.Future[Any]) -> None:
    """The owner answered ``remote()`` (or it failed): an error waits for the first use."""
    if not creation.cancelled():
        creation.exception()  # retrieved: the first use of the RRef raises it
    context.event(context.state.fork_confirmed, rref)


class _Registration:
    """``remote()``'s RRef and the creator's fork, in its request to the owner, which
    records them in link order, before anything later on the link: a ``to_here`` or
    method call sent after ``remote()`` must find the RRef.

    It pickles as a call of :func:`_register`, so the owner records them as the request
    unpickles, before anything in the request can hold the call back (``start_after``).
    That only happens to a request some reducer took part in (an RRef among the
    arguments).  A plain or lean request (the commonest: a function and its tensors and
    scalars) unpickles without a Transfer and its call starts at once: there
    ``_register`` gives the registration back and ``_create`` records it, as it starts.
    The request is then as cheap to make and read as any small call's."""

    __slots__ = ("fork", "rref")

    def __init__(self, rref: RRefId, fork: ForkId) -> None:
        self.rref, self.fork = rref, fork

    def __reduce__(self) -> tuple[Any, tuple[RRefId, ForkId]]:
        return _register, (self.rref, self.fork)


def _register(rref: RRefId, fork: ForkId) -> tuple[RRefId, bool] | _Registration:
    """On the owner, as the request unpickles: count the creator's fork; returns the
    RRef's id and whether this is the first request to make it.  Without a Transfer (a
    plain or lean request) the registration itself, for ``_create``."""
    if current_transfer() is None:
        return _Registration(rref, fork)
    return _owner_create(_receiving_context(), rref, fork)


def _owner_create(context: RRefContext, rref: RRefId, fork: ForkId) -> tuple[RRefId, bool]:
    with context._lock:
        first = context.state.owner_create(rref, fork, rref[0])
    context.value_of(rref)
    return rref, first


@async_execution
def _create(
    registered: tuple[RRefId, bool] | _Registration,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> asyncio.Future[None]:
    """Owner side of ``remote()`` (the RRef registered as the request unpickled, or here,
    see ``_Registration``): make the value; reply when it is made (with nothing: the
    value stays here) or failed."""
    context = context_for(_agent())
    if isinstance(registered, _Registration):
        registered = _owner_create(context, registered.rref, registered.fork)
    rref, first = registered
    value = context.value_of(rref)
    outcome: asyncio.Future[None] = value.get_loop().create_future()
    if first:
        context.agent.invoke(func, args, kwargs).add_done_callback(
            lambda made: _settle_value(value, made, outcome)
        )
    else:
        value.add_done_callback(functools.partial(_copy_outcome, target=outcome, with_result=False))
    return outcome


def _settle_value(
    value: asyncio.Future[Any], made: asyncio.Future[Any], outcome: asyncio.Future[None]
) -> None:
    """The value is made (or failed): the creator's confirmation is settled first, so it
    leaves before any ``to_here`` reply (their completions run in that order), and the
    creator has its fork confirmed by the time it has the value."""
    _copy_outcome(made, outcome, with_result=False)
    _copy_outcome(made, value)
    if value.done() and not value.cancelled():
        value.exception()  # retrieved: it is raised to whoever uses the RRef


def _copy_outcome(
    source: asyncio.Future[Any], target: asyncio.Future[Any], *, with_result: bool = True
) -> None:
    """Settle ``target`` as ``source`` ended, unless it is settled: cancelled, its error,
    or its result (None without ``with_result``: a creation's reply to its creator)."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result() if with_result else None)


@async_execution
def _fetch(rref: RRefId) -> asyncio.Future[Any]:
    """Owner side of ``to_here()``: the value, once made."""
    return context_for(_agent()).value_of(rref)


# -- pickling handles --------------------------------------------------------------------


def _reduce_rref(handle: RRef[Any]) -> Any:
    transfer = current_transfer()
    if transfer is None:
        raise SerializationError(
            f"{handle!r} can only be pickled into asyncrpc calls (arguments or results)"
        )
    context = context_for(transfer.agent)
    rref, to = handle._id, transfer.peer_rank
    try:
        with context._lock:
            fork = context.state.send(rref, to, transfer.request)
    except KeyError:
        raise handle._released_error() from None
    transfer.undo.append(lambda: context.event(context.state.unsend, rref, fork))
    return _rebuild_rref, (rref, handle._owner, fork, context.rank)


def _rebuild_rref(rref: RRefId, owner: int, fork: ForkId | None, parent: int) -> RRef[Any]:
    context = _receiving_context()
    try:
        context.event(context.state.receive, rref, owner, fork, parent)
    except KeyError:
        raise RRefError(
            f"RRef {rref} does not exist on its owner {context.agent.info.name!r} any more"
        ) from None
    if owner == context.rank:  # a call given its owner's RRef starts once the value is made
        start_after(context.value_of(rref))  # (so local_value() works in it, as in torch)
    return _handle_type(context)._attach(context, rref, owner)


def _handle_type(context: RRefContext) -> type[RRef[Any]]:
    """The class of the handles this worker makes (a layer above may set a subclass)."""
    return context.handle_type or RRef


def _receiving_context() -> RRefContext:
    transfer = current_transfer()
    if transfer is None:
        raise SerializationError("RRefs can only be unpickled from asyncrpc messages")
    return context_for(transfer.agent)


def _agent() -> RpcAgent:
    agent = current_agent()
    if agent is None:
        raise AgentStateError("RPC is not initialised: call `await asyncrpc.init_rpc(...)` first")
    return agent


register_reducer(RRef, _reduce_rref)
register_reducer(_MethodCall, _reduce_method_call)
register_plain(_Registration)
