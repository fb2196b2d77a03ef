"""Which message a value is being (de)serialised for, so reducers can take part.

Theory of operation
-------------------
Most values pickle the same way whatever their destination.  A few do not: an
RRef handle sent to another worker must register a fork with its owner (or pin
its sender) *as* it is pickled, and must attach itself to the receiving worker's
reference table as it is unpickled.  Such reducers live in upper layers and need
to know the agent, the peer at the other end and whether the value rides in a
request or in a reply (the two travel on different links, which matters for
ordering).  The agent sets a :class:`Transfer` in a context variable around
every ``dumps``/``loads`` of a message; :func:`current_transfer` reads it.

A reducer that changes state while pickling registers an ``undo`` callback: if
serialisation of the whole message fails, the message never leaves and every
undo runs, so no state change outlives a message that was not sent.

A reducer that finds, while a request is unpickled, something the call must not
start without (the value of an RRef its owner is still making) calls
:func:`start_after`: the call then starts once that future is done, without
holding the loop or a thread meanwhile.

Context variables registered with :func:`propagate` travel with every request
(in the frame's header) and are set while the called function runs:
distributed autograd uses this to run a callee inside the caller's context.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrpc.serde import dumps, loads

if TYPE_CHECKING:
    from asyncrpc.agent.agent import RpcAgent


@dataclass(slots=True)
class Transfer:
    """One message being serialised to, or deserialised from, ``peer_rank``."""

    agent: RpcAgent
    peer_rank: int
    request: bool  # a request (else a reply); requests and replies use different links
    undo: list[Callable[[], None]] = field(default_factory=list)  # see dumps_for
    waits: list[asyncio.Future[Any]] = field(default_factory=list)  # see start_after


_transfer: contextvars.ContextVar[Transfer | None] = contextvars.ContextVar(
    "asyncrpc_transfer", default=None
)


_propagated: dict[str, contextvars.ContextVar[Any]] = {}


def propagate(key: str, variable: contextvars.ContextVar[Any]) -> None:
    """Carry ``variable`` (when not None; a msgpack-able value) with every request."""
    _propagated[key] = variable


def carried() -> dict[str, Any] | None:
    """The propagated variables set in the caller's context, for a request's header."""
    found = {key: value for key, var in _propagated.items() if (value := var.get()) is not None}
    return found or None


def apply_carried(context: contextvars.Context, values: Any) -> None:
    """Set, in a call's context, the variables a request carried."""
    if not isinstance(values, dict):
        return
    for key, value in values.items():
        variable = _propagated.get(key)
        if variable is not None:
            context.run(variable.set, value)


def current_transfer() -> Transfer | None:
    """The message being (de)serialised in this thread, if any."""
    return _transfer.get()


def start_after(future: asyncio.Future[Any]) -> None:
    """While a request is unpickled: its call starts only once ``future`` is done."""
    transfer = _transfer.get()
    if transfer is not None and transfer.request and not future.done():
        transfer.waits.append(future)


Undo = list[Callable[[], None]]


def dumps_for(
    agent: RpcAgent, peer_rank: int, request: bool, value: Any
) -> tuple[bytes, list[memoryview], Undo]:
    """``serde.dumps`` for a message to ``peer_rank``.

    Also returns the undo callbacks of the reducers that ran: call :func:`undo` on
    them if the message is never sent.  If serialisation fails they run here.
    """
    transfer = Transfer(agent, peer_rank, request)
    token = _transfer.set(transfer)
    try:
        payload, buffers = dumps(value)
    except BaseException:
        undo(transfer.undo)
        raise
    finally:
        _transfer.reset(token)
    return payload, buffers, transfer.undo


def undo(callbacks: Undo) -> None:
    """Revert what reducers did for a message that will not be sent (latest first)."""
    while callbacks:
        callbacks.pop()()


def loads_from(
    agent: RpcAgent,
    peer_rank: int,
    request: bool,
    payload: bytes | bytearray,
    buffers: Sequence[Any],
    *,
    waits: list[asyncio.Future[Any]] | None = None,
) -> Any:
    """``serde.loads`` for a message that came from ``peer_rank``; a request's call must
    not start before the futures added to ``waits`` are done (see :func:`start_after`)."""
    token = _transfer.set(Transfer(agent, peer_rank, request, waits=[] if waits is None else waits))
    try:
        return loads(payload, buffers)
    finally:
        _transfer.reset(token)
