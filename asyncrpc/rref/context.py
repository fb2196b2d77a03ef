"""The asyncio shell around one worker's RRef state machine.

Theory of operation
-------------------
:class:`RRefContext` is an agent extension.  It feeds events to
:class:`~asyncrpc.rref.protocol.RRefState` under a lock (handles are pickled in
pool threads too) and carries out the instructions that come back on the event
loop: a ForkRequest becomes a small RPC to an ``@on_loop`` handler (its reply is
the owner's confirmation); ChildAccepted and ForkDeleted, which need no reply,
become one-way notices (:mod:`asyncrpc.agent.notices`: they ride on the next
frame to that worker, and keep their order with the frames around them);
``Free`` drops a value, ``Orphan`` fails one.  A ``remote()`` whose RRef then
dies thus costs its owner two requests and a notice, not three requests.

Owner side, each RRef's value is an asyncio future in ``values`` (made when the
RRef is first heard of, set when its function finishes), so a ``to_here`` or a
method call that overtakes the ``remote()`` that makes the value simply waits.

A Python handle that dies (in any thread, perhaps inside the garbage collector)
only appends its id to a queue; the loop drains the queue.  So the state is
never touched from a finaliser, and counting handles instead of flagging them
makes the order of deaths and births irrelevant.

Graceful shutdown (``drain``, once every worker has stopped making calls):
wait until every fork we hold is confirmed and no child we sent is still
pinned, then delete every fork we hold, whatever Python still refers to it.
Those notices leave before our SHUTDOWN of the second phase, so an owner
has handled them before it can pass that barrier.  Every wait is bounded by the
agent's shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from asyncrpc.agent import RpcAgent, current_agent, on_loop, on_notice
from asyncrpc.errors import AgentStateError, PeerLostError, RRefError
from asyncrpc.rref.protocol import (
    ChildAccepted,
    ForkDeleted,
    ForkId,
    ForkRequest,
    Free,
    Instruction,
    Orphan,
    RRefId,
    RRefState,
    Send,
)

log = logging.getLogger("asyncrpc.rref")


class RRefContext:
    """One worker's RRefs: the protocol state, the owned values, the messages in flight."""

    # The class of the RRef handles workers of this process make (None: asyncrpc.RRef).
    # A layer above (asyncrpc.compat) sets its subclass of RRef while it runs.
    handle_type: type[Any] | None = None

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.rank = agent.info.id
        self.state = RRefState(self.rank)
        self.values: dict[RRefId, asyncio.Future[Any]] = {}
        self._loop = agent.loop
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._dropped: deque[RRefId] = deque()
        self._drain_scheduled = False
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._changed = asyncio.Event()
        self.closed = False

    # -- events --------------------------------------------------------------------

    def event(self, step: Callable[..., list[Instruction]], *args: Any) -> None:
        """Apply one state-machine step and carry out what it says (any thread)."""
        with self._lock:
            instructions = step(*args)
        self._carry_out(instructions)  # also wakes `drain`, even with nothing to do

    def _carry_out(self, instructions: list[Instruction]) -> None:
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._carry_out, instructions)
            return
        for instruction in instructions:
            if isinstance(instruction, Send):
                self._post(instruction.to, instruction.message)
            elif isinstance(instruction, Free):
                self.values.pop(instruction.rref, None)
            elif isinstance(instruction, Orphan):
                self._fail(instruction.rref, instruction.creator)
        self._changed.set()

    def _fail(self, rref: RRefId, creator: int) -> None:
        future = self.values.get(rref)
        name = self.agent.resolve(creator).name
        if future is not None and not future.done():
            future.set_exception(
                PeerLostError(
                    f"worker {name!r} died before RRef {rref} was made on {self.agent.info.name!r}",
                    worker=name,
                )
            )
            future.exception()  # retrieved: whoever uses it will see it

    def _post(self, to: int, message: Any) -> None:
        if self.closed or not self.agent.state.usable:
            return
        try:
            if isinstance(message, ForkRequest):
                self._request_fork(to, message)
            else:  # no reply wanted: a notice
                self.agent.notify(to, _NOTICES[type(message)], *message.rref, *message.fork)
        except Exception as exc:  # e.g. the worker is unknown: nothing to tell it
            log.warning("cannot send %s to worker %d: %s", message, to, exc)

    def _request_fork(self, to: int, request: ForkRequest) -> None:
        """Ask the owner to count a fork: its reply is the confirmation."""
        sent = self.agent.rpc_async(to, _on_fork_request, (request.rref, request.fork, self.rank))
        self._in_flight.add(sent)
        sent.add_done_callback(lambda f: self._answered(f, request))

    def _answered(self, sent: asyncio.Future[Any], request: ForkRequest) -> None:
        self._in_flight.discard(sent)
        error = None if sent.cancelled() else sent.exception()
        # Answered, or failed after it left: either way our later ForkDeleted follows
        # it on the same link (and a dead owner's RRefs are forgotten anyway).
        self.event(self.state.fork_confirmed, request.rref)
        if error is not None and not isinstance(error, (PeerLostError, AgentStateError)):
            log.warning("RRef message %s failed: %s", request, error)
        self._changed.set()

    # -- handles -------------------------------------------------------------------

    def create_local(self, value: asyncio.Future[Any]) -> RRefId:
        """An owned RRef for ``value`` (a future of it), with one handle."""
        with self._lock:
            rref = self.state.create_local()
        self.values[rref] = value
        return rref

    def value_of(self, rref: RRefId) -> asyncio.Future[Any]:
        """Owner: the future of ``rref``'s value (made if this is the first we hear)."""
        future = self.values.get(rref)
        if future is not None:
            return future
        owned = self.state.owned.get(rref)
        if owned is None:
            why = (
                "it was freed when a worker that held it died"
                if rref in self.state.gone
                else "it was freed, or never created here"
            )
            here = self.agent.info.name
            raise RRefError(f"RRef {rref} does not exist on worker {here!r} ({why})")
        future = self.values[rref] = self._loop.create_future()
        if owned.orphaned:
            self._fail(rref, owned.creator)
        return future

    def dropped(self, rref: RRefId) -> None:
        """A Python handle died (any thread, maybe inside the GC): count it later."""
        self._dropped.append(rref)
        if self._drain_scheduled or self.closed:
            return
        self._drain_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to release
            if threading.get_ident() == self._loop_thread:
                self._loop.call_soon(self.count_dropped)  # (no wake-up to write)
            else:
                self._loop.call_soon_threadsafe(self.count_dropped)

    def count_dropped(self) -> None:
        """Count the handles dropped so far, now (any thread): scheduled after a drop, and
        called by ``remote()``, so that their deletions ride on its request."""
        self._drain_scheduled = False
        while self._dropped:
            self.event(self.state.handle_dropped, self._dropped.popleft())

    # -- agent extension -----------------------------------------------------------

    def peer_lost(self, rank: int) -> None:
        self.event(self.state.peer_lost, rank)

    async def drain(self) -> None:
        self.count_dropped()
        while not (self.state.settled and not self._in_flight):
            self._changed.clear()
            await self._changed.wait()
        self.event(self.state.release_all)  # (notices only: nothing more to wait for)

    def close(self) -> None:
        """Every peer is done or dead: nothing can use an RRef here any more."""
        self.closed = True
        self.values.clear()
        with self._lock:
            self.state = RRefState(self.rank)

    def debug_info(self) -> dict[str, Any]:
        return {
            "owner_rrefs": sum(1 for owned in self.state.owned.values() if owned.forks),
            "user_rrefs": len(self.state.held),
        }


def context_for(agent: RpcAgent) -> RRefContext:
    """The RRef context of ``agent`` (made on first use)."""
    return agent.extension("rref", RRefContext)


def _here() -> RRefContext:
    agent = current_agent()
    if agent is None:
        raise AgentStateError("RRef message outside of a running agent")
    return context_for(agent)


# -- the protocol's message handlers, run on the receiving worker's loop -----------


@on_loop
def _on_fork_request(rref: RRefId, fork: ForkId, sender: int) -> None:
    context = _here()
    with context._lock:
        context.state.fork_requested(rref, fork, sender)


def _ids(sender: int, args: tuple[Any, ...]) -> tuple[RRefId, ForkId]:
    """A notice's RRef and fork ids (four ints); ValueError (logged by the agent, which
    keeps serving) for anything else."""
    if len(args) != 4 or any(type(arg) is not int for arg in args):
        raise ValueError(f"malformed RRef notice from worker {sender}: {args!r}")
    return (args[0], args[1]), (args[2], args[3])


def _on_child_accepted(agent: RpcAgent, sender: int, *args: Any) -> None:
    context = context_for(agent)
    context.event(context.state.child_accepted, *_ids(sender, args))


def _on_fork_deleted(agent: RpcAgent, sender: int, *args: Any) -> None:
    context = context_for(agent)
    context.event(context.state.fork_deleted, *_ids(sender, args))


_NOTICES: dict[type, str] = {ChildAccepted: "rref.child_accepted", ForkDeleted: "rref.fork_deleted"}
on_notice(_NOTICES[ChildAccepted], _on_child_accepted)
on_notice(_NOTICES[ForkDeleted], _on_fork_deleted)
