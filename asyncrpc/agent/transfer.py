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

A reducer that changes state while pickling registers an ``undo`` callback:
the message comes out of :func:`dumps_request` or :func:`dumps_reply` as an
:class:`~asyncrpc.agent.outgoing.Outgoing` that owns those callbacks, and runs
them if it never leaves.  If serialisation itself fails they run at once.  So
no state change outlives a message that was not sent.

A reducer that finds, while a request is unpickled, something the call must not
start without (the value of an RRef its owner is still making) calls
:func:`start_after`: the call then starts once that future is done, without
holding the loop or a thread meanwhile.

CUDA tensors find their message's route (device map, CUDA IPC or not) through
the same context variable: :func:`_cuda_destination` asks the agent.  Their
copies to pinned host memory are still running when ``dumps`` returns; the
events that say they are done go into ``Outgoing.staged``, and the message is
written once they have fired.

A message no reducer has a part in (``serde.dumps_plain``: a call of scalars, a
``None`` reply) has nothing to undo, stage or attach.  Its sender pickles it with
``dumps_plain`` and writes it as it is, without coming here: it says so with ``PLAIN``
in its header, and its receiver unpickles it without a :class:`Transfer` (nothing in
it asks for one; a reducer that asked would find none, and an RRef's then raises).
Most small calls and their replies are plain, and skip ~1 µs a message here (the
Transfer and its context variable).  So are those whose only parts beyond pickle's own
are plain CPU tensors and arrays: ``_dumps`` tries ``serde.lean`` first, which puts
their entries in the header under ``TENSORS``, and their receiver rebuilds them with
``loads_lean``.  ``dumps_request`` and ``dumps_reply`` are for
the others: given a plain value they still work, only without the mark.

Context variables registered with :func:`propagate` travel with every request
(in the frame's header) and are set while the called function runs:
distributed autograd uses this to run a callee inside the caller's context.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from asyncrpc.agent.outgoing import Outgoing, Undo, undo_all
from asyncrpc.serde import cuda, dumps, loads
from asyncrpc.serde.lean import dumps_lean, loads_lean
from asyncrpc.wire import Kind


@dataclass(slots=True)
class Transfer:
    """One message being serialised to, or deserialised from, ``peer_rank``."""

    # The agent at this end.  Opaque here (this module needs nothing of it); the upper
    # layers whose reducers read it know its type.
    agent: Any
    peer_rank: int
    request: bool  # a request (else a reply); requests and replies use different links
    undo: list[Undo] = field(default_factory=list)  # see dumps_request
    waits: list[asyncio.Future[Any]] = field(default_factory=list)  # see start_after
    function: str = "?"
    staged: list[Any] = field(default_factory=list)  # CUDA copies the message waits for

    def what(self) -> str:
        """The message, as errors name it."""
        if self.request:
            return f"call to {self.function}"
        return f"reply of {self.function}"


TENSORS: Final = "t"
"""Header key of a plain message's tensors and arrays: their entries (serde.lean), in
the order of its buffers."""
PLAIN: Final = "p"
"""Header key of a message whose payload no reducer had a part in (see the module doc)."""
BY_NAME: Final = "r"
"""Header key of a request whose function travels by name, ``"module:qualname"``, beside
its payload of ``(args, kwargs)`` (see serde.references); without it the payload is
``(function, args, kwargs)``."""

_transfer: contextvars.ContextVar[Transfer | None] = contextvars.ContextVar(
    "asyncrpc_transfer", default=None
)


_propagated: dict[str, contextvars.ContextVar[Any]] = {}


def propagate(key: str, variable: contextvars.ContextVar[Any]) -> None:
    """Carry ``variable`` (when not None; a msgpack-able value) with every request."""
    _propagated[key] = variable


def carried() -> dict[str, Any] | None:
    """The propagated variables set in the caller's context, for a request's header."""
    found = None  # (a loop, not a comprehension: no dict made for most calls, which carry none)
    for key, variable in _propagated.items():
        value = variable.get()
        if value is not None:
            if found is None:
                found = {}
            found[key] = value
    return found


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


def _cuda_destination() -> cuda.Destination:
    """The route of the message being serialised in this thread (see serde.cuda)."""
    transfer = _transfer.get()
    if transfer is None:
        return None, None
    route = transfer.agent.cuda_route(transfer.peer_rank, reply=not transfer.request)
    return route.named(f"{transfer.what()} for worker {route.peer!r}"), transfer.staged


cuda.set_destination(_cuda_destination)


def dumps_request(
    agent: Any, peer_rank: int, value: Any, *, call_id: int, function: str
) -> Outgoing:
    """Call ``call_id`` of ``function`` (``value``: what to run) for worker ``peer_rank``,
    serialised by ``agent``, as a REQUEST that undoes its reducers' effects if it never
    leaves."""
    message = _dumps(agent, peer_rank, True, function, value)
    message.meta["i"], message.meta["f"] = call_id, function
    return message


def dumps_reply(agent: Any, peer_rank: int, value: Any, *, call_id: int, function: str) -> Outgoing:
    """The result of call ``call_id`` (of ``function``) from worker ``peer_rank``,
    serialised by ``agent``, as a RESPONSE that undoes its reducers' effects if it never
    leaves."""
    message = _dumps(agent, peer_rank, False, function, value)
    message.meta["i"] = call_id
    return message


def _dumps(agent: Any, peer_rank: int, request: bool, function: str, value: Any) -> Outgoing:
    kind = Kind.REQUEST if request else Kind.RESPONSE
    lean = dumps_lean(value)
    if lean is not None:  # no reducer has a part in it: nothing to undo or stage
        payload, entries, buffers = lean
        meta: dict[str, Any] = {PLAIN: True, TENSORS: entries} if entries else {PLAIN: True}
        return Outgoing(kind, meta, payload, buffers, function=function)
    transfer = Transfer(agent, peer_rank, request, function=function)
    token = _transfer.set(transfer)
    try:
        payload, buffers = dumps(value)
    except BaseException:
        undo_all(transfer.undo)  # the message does not even exist
        raise
    finally:
        _transfer.reset(token)
    message = Outgoing(kind, {}, payload, buffers, function=transfer.function, undo=transfer.undo)
    message.staged = transfer.staged
    return message


def loads_request(
    agent: Any,
    peer_rank: int,
    payload: bytes | bytearray,
    buffers: Sequence[Any],
    *,
    plain: bool,
    waits: list[asyncio.Future[Any]],
    tensors: Any = None,
) -> Any:
    """``serde.loads`` for a request from ``peer_rank`` (``plain``: its header says
    ``PLAIN``; ``tensors``: its ``TENSORS``, if any); its call must not start before the
    futures added to ``waits`` are done (see :func:`start_after`)."""
    if plain or tensors is not None:
        return _loads_plain(payload, buffers, tensors)
    return _loads(Transfer(agent, peer_rank, True, waits=waits), payload, buffers)


def loads_reply(
    agent: Any,
    peer_rank: int,
    payload: bytes | bytearray,
    buffers: Sequence[Any],
    *,
    plain: bool,
    tensors: Any = None,
) -> Any:
    """``serde.loads`` for a reply from ``peer_rank`` (``plain``: its header says
    ``PLAIN``; ``tensors``: its ``TENSORS``, if any)."""
    if plain or tensors is not None:
        return _loads_plain(payload, buffers, tensors)
    return _loads(Transfer(agent, peer_rank, False), payload, buffers)


def _loads_plain(payload: bytes | bytearray, buffers: Sequence[Any], tensors: Any) -> Any:
    """A plain message's value, no Transfer needed: through ``serde.lean`` if its header
    carried the entries of its tensors and arrays."""
    if tensors is not None:
        return loads_lean(payload, tensors, buffers)
    return loads(payload, buffers)


def _loads(transfer: Transfer, payload: bytes | bytearray, buffers: Sequence[Any]) -> Any:
    token = _transfer.set(transfer)
    try:
        return loads(payload, buffers)
    finally:
        _transfer.reset(token)
