"""The per-worker RPC agent: peers, pending calls, deadlines, dispatch, shutdown.

Theory of operation
-------------------
A worker listens on every transport it offers and dials a peer on first use.
Links are one-way for calls: requests go out on links we dialed and come in on
links peers dialed; each request's reply returns on the link it came in on.  So
two workers that call each other hold two links, and no tie-break is needed.

Outgoing: ``rpc_async`` serialises at once (a bad argument raises right there),
records a :class:`PendingCall` with a deadline timer, and writes the request
(or queues it behind the dial).  Tensor bytes are never copied on the loop: a
large buffer for a same-host peer is copied into shared memory by the Link's
copier threads, in order with the link's other messages, within this worker's
shared-memory budget (``shared_memory_budget``; beyond it the bytes go through
the socket).  The debug info reports the pool and the peers' segments we map.
The call ends exactly once: by its reply, by its deadline (``RPCTimeoutError``,
and a CANCEL to the callee), or by the loss of its link (``PeerLostError`` at
once, naming the peer).

Incoming: see :mod:`asyncrpc.agent.dispatch` for where a function runs.  Under
a backlog of running calls a link stops reading until the backlog halves.  At
most ``max_pending_handshakes`` accepted connections may be authenticating at
once (:mod:`asyncrpc.transport.admission`); each for ``handshake_timeout`` at
most.

Sizes: both ends of a link announced their ``max_frame_size`` in the
handshake, and a message above the smaller one fails alone, on the sending
side, with ``LocalProtocolError``: a request at once from ``rpc_async`` (or
through its future when the link was still being dialed), a reply as the
call's ERROR reply.  The link stays up.

Shutdown (graceful) is two barriers; we keep serving throughout.  Phase 1: wait
for our own calls to finish, tell every peer SHUTDOWN, and wait until every
peer has said so too or is known dead.  Now no user code anywhere starts a
call.  Then every extension drains (the RRef layer gives back its handles to
their owners), and phase 2 repeats the barrier, so nobody closes while a peer
still talks to it.  Then close.  Every wait is bounded.

Extensions: upper layers (RRefs, distributed autograd) attach one object each
with :meth:`RpcAgent.extension`; the agent tells them of lost peers, lets them
drain before the shutdown barrier, closes them, and merges their debug info.
Lower layers stay ignorant of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from asyncrpc.agent.dispatch import function_name, unpack_error
from asyncrpc.agent.inbound import Inbound
from asyncrpc.agent.notices import Notices, delivered, handle
from asyncrpc.agent.polling import BusyPoller
from asyncrpc.agent.transfer import Undo, carried, dumps_for, loads_from, undo
from asyncrpc.agent.worker import WorkerAddress, WorkerInfo
from asyncrpc.errors import (
    AgentStateError,
    HandshakeError,
    LocalProtocolError,
    PeerLostError,
    RPCTimeoutError,
    SerializationError,
    UnknownWorkerError,
)
from asyncrpc.serde import allocate_tensor_storage
from asyncrpc.transport import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_IDLE,
    Admission,
    Link,
    SegmentPool,
    dial,
    host_identity,
    listen,
    too_large,
)
from asyncrpc.wire import DEFAULT_MAX_FRAME_SIZE, Frame, Handshake, Identity, Kind, Role

log = logging.getLogger("asyncrpc.agent")
DEFAULT_BUSY_POLL = 300e-6  # seconds; see asyncrpc.agent.polling
_current: contextvars.ContextVar[RpcAgent] = contextvars.ContextVar("asyncrpc_agent")


class Extension(Protocol):
    """What an upper layer attaches to an agent (see :meth:`RpcAgent.extension`)."""

    def peer_lost(self, rank: int) -> None:
        """A connection with worker ``rank`` was lost: treat it as gone."""

    async def drain(self) -> None:
        """Graceful shutdown is starting: finish and release what involves peers."""

    def close(self) -> None:
        """The agent is closing; drop everything."""

    def debug_info(self) -> dict[str, Any]:
        """Entries to merge into the agent's debug info."""


E = TypeVar("E", bound=Extension)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """Tunables of one agent (see ``init_rpc`` for their meaning)."""

    rpc_timeout: float = 60.0
    num_worker_threads: int = 16
    transports: tuple[str, ...] = ("unix", "tcp")
    listen_host: str = "127.0.0.1"
    shared_memory: bool = True
    shared_memory_budget: int = DEFAULT_BUDGET
    shared_memory_idle: int = DEFAULT_MAX_IDLE
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    connect_timeout: float = 30.0
    handshake_timeout: float = 10.0
    busy_poll: float | None = None  # None: DEFAULT_BUSY_POLL while this host has a CPU each
    max_running_per_link: int = 4096
    max_pending_handshakes: int = 64  # inbound connections authenticating at once

    def timeout_for(self, timeout: float | None) -> float:
        """A call's timeout in seconds, as torch reads it: None or negative (torch's
        ``UNSET_RPC_TIMEOUT``, -1) means ``rpc_timeout``; 0 means none."""
        return self.rpc_timeout if timeout is None or timeout < 0 else timeout

    def __post_init__(self) -> None:
        if self.shared_memory_budget < 0 or self.shared_memory_idle < 0:
            raise ValueError("shared_memory_budget and shared_memory_idle must be >= 0")


@dataclass(slots=True)
class PendingCall:
    future: asyncio.Future[Any]
    peer: str
    function: str
    timeout: float
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True, slots=True)
class OutgoingRequest:
    """A serialised request, held only until it is written (or its dial fails)."""

    call_id: int
    meta: dict[str, Any]
    payload: bytes
    buffers: list[memoryview]
    undo: Undo = field(default_factory=list)  # reverts reducers' effects if never sent


class RpcAgent:
    """One worker's agent.  Create, ``await start()``, ``join(workers)``, use, ``shutdown``."""

    def __init__(self, name: str, rank: int, secret: bytes, options: AgentOptions) -> None:
        self.options = options
        self.info = WorkerInfo(rank, name)
        self.identity = Identity(name, rank, os.getpid(), host_identity())
        self.address = WorkerAddress(name, rank, self.identity.host)
        self._secret = secret
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()
        self._context.run(_current.set, self)
        self._poller = BusyPoller(0.0, self._worth_polling)  # its window is set in join()
        self._inbound = Inbound(
            name,
            self._context,
            options.num_worker_threads,
            options.max_running_per_link,
            loads_request=lambda rank, payload, buffers, waits: loads_from(
                self, rank, True, payload, buffers, waits=waits
            ),
            dumps_reply=lambda rank, result: dumps_for(self, rank, False, result),
        )
        self._extensions: dict[str, Extension] = {}
        self._segments = (
            SegmentPool(options.shared_memory_budget, options.shared_memory_idle)
            if options.shared_memory
            else None
        )
        self._workers: dict[str, WorkerAddress] = {}
        self._by_rank: dict[int, WorkerAddress] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._admission = Admission(options.max_pending_handshakes)
        self._links: dict[str, Link] = {}  # outgoing, by peer name
        self._dials: dict[str, asyncio.Future[Link]] = {}
        # Requests waiting for a peer's link, in call order: one task sends them all once
        # it is up, so a call made after the link came up cannot overtake them.
        self._backlog: dict[str, list[OutgoingRequest]] = {}
        self._pending: dict[int, PendingCall] = {}
        self._notices = Notices()
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._peers_done: dict[int, set[str]] = {1: set(), 2: set()}  # by barrier phase
        self._dead: set[str] = set()
        self._phases_reached: set[int] = set()  # barrier phases this worker has announced
        # Frames that arrive before join(): a peer that finished the rendezvous first may
        # call us already, and our calls' handlers need to know every worker.
        self._early_frames: list[tuple[Link, Frame]] | None = []
        self._barrier_changed = asyncio.Event()
        self.state = "new"
        self.closing_debug_info: dict[str, Any] = {}

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> WorkerAddress:
        """Listen on every configured transport; returns the address to publish."""
        addresses = {}
        for scheme in self.options.transports:
            target = (
                f"unix://@asyncrpc-{self.identity.pid}-{id(self):x}"
                if scheme == "unix"
                else f"tcp://{self.options.listen_host}:0"
            )
            server, bound = await listen(target, self._inbound_link)
            self._servers.append(server)
            addresses[scheme] = bound
        self.address = WorkerAddress(self.info.name, self.info.id, self.identity.host, addresses)
        self.state = "listening"
        return self.address

    def join(self, workers: list[WorkerAddress]) -> None:
        """Learn every worker of the job (from rendezvous); calls may start."""
        self._workers = {w.name: w for w in workers}
        self._by_rank = {w.rank: w for w in workers}
        self._poller.window = self._busy_poll_window(workers)
        self.state = "running"
        early, self._early_frames = self._early_frames or [], None
        for link, frame in early:
            if not link.closed:
                self.frame_received(link, frame)

    def _busy_poll_window(self, workers: list[WorkerAddress]) -> float:
        """The configured window; by default, polling only while every worker of this
        host can have a CPU of its own (a spinning loop takes one from a busy peer)."""
        if self.options.busy_poll is not None:
            return self.options.busy_poll
        here = sum(1 for w in workers if w.host == self.identity.host)
        return DEFAULT_BUSY_POLL if here <= len(os.sched_getaffinity(0)) else 0.0

    async def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Leave the job.  Graceful: wait for our calls and for every live peer to call
        shutdown too, then release what they share (RRefs, contexts) and close.

        ``timeout=None``: wait for the others as long as they are alive (a worker that
        only serves calls shutdown at once and waits out the job, as in torch), then
        bound the release by ``rpc_timeout``.  A number bounds the whole of it; 0 or
        less means no bound at all.
        """
        if self.state in ("closing", "closed"):
            return
        try:
            if graceful and self.state == "running":
                if timeout is None:
                    await self._arrive()
                    await self._within(self.options.rpc_timeout, self._depart())
                else:
                    await self._within(timeout, self._arrive_and_depart())
        finally:
            await self._close()

    async def _arrive(self) -> None:
        """Our calls are done and every live peer has called shutdown."""
        await self._idle.wait()  # each call is bounded by its own timeout
        await self._barrier(1)  # a peer that dies is skipped

    async def _depart(self) -> None:
        """Extensions release what peers share; then all meet again and may close."""
        for extension in list(self._extensions.values()):
            await extension.drain()
        await self._idle.wait()
        await self._barrier(2)

    async def _arrive_and_depart(self) -> None:
        await self._arrive()
        await self._depart()

    async def _within(self, bound: float, step: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(bound if bound > 0 else None):
                await step
        except TimeoutError:
            raise RPCTimeoutError(
                f"shutdown of {self.info.name!r} timed out after {bound}s: {self._waiting_for()}"
            ) from None

    def _waiting_for(self) -> str:
        if self._pending:
            calls = sorted({f"{c.function} on {c.peer!r}" for c in self._pending.values()})
            return f"{len(self._pending)} of our calls still pending ({', '.join(calls[:5])})"
        others = set(self._workers) - {self.info.name}
        if others - self._peers_done[1] - self._dead:
            missing = sorted(others - self._peers_done[1] - self._dead)
            return f"workers that have not called shutdown: {missing}"
        missing = sorted(others - self._peers_done[2] - self._dead)
        return f"workers still releasing their RRefs and the like: {missing}"

    async def _barrier(self, phase: int) -> None:
        self.state = "draining"
        self._phases_reached.add(phase)
        others = [name for name in self._workers if name != self.info.name]
        await asyncio.gather(*(self._announce_shutdown(name) for name in others))
        while not set(others) <= self._peers_done[phase] | self._dead:
            self._barrier_changed.clear()
            await self._barrier_changed.wait()

    async def _announce_shutdown(self, name: str) -> None:
        """Tell ``name`` the phases we reached, on any link we share with it (a peer
        whose loop is busy cannot complete a new handshake, but reads an open link once
        free).  Without one we dial: a peer that cannot be reached is dead, one that
        accepts the connection but does not finish the handshake in time is alive and
        busy, and is dialled again."""
        while True:
            link = self._links.get(name) or self._inbound.link_from(name)
            if link is not None:
                break
            try:
                link = await self._connect(name)
            except (PeerLostError, TimeoutError) as exc:
                if _busy(exc):
                    continue
                self._mark_dead(name)
                return
        self._dead.discard(name)  # a lost link earlier, but it is alive: wait for it
        self._send_phases(link)

    def _send_phases(self, link: Link) -> None:
        """Every phase reached, again (a peer once given up for dead may have missed some;
        a repeated notice changes nothing), after the notices queued for it."""
        notices = self._notices.take(link.peer.name)
        if notices:
            link.send(Kind.NOTICE, {"n": notices})
        for phase in sorted(self._phases_reached):
            link.send(Kind.SHUTDOWN, {"rank": self.info.id, "phase": phase})

    def _on_shutdown_notice(self, link: Link, phase: Any) -> None:
        if phase not in self._peers_done:
            return
        name = link.peer.name
        self._peers_done[phase].add(name)
        if name in self._dead:  # given up for dead (it could not be dialled), yet alive:
            self._dead.discard(name)  # it waits for our notices, and we for its
            self._send_phases(link)
        self._barrier_changed.set()

    async def _close(self) -> None:
        self.closing_debug_info = self.debug_info()  # what was left: leaks show here
        self.state = "closing"
        for server in self._servers:
            server.close()
        closed = AgentStateError(f"worker {self.info.name!r} shut down")
        for call_id in list(self._pending):
            self._finish(call_id, error=closed)
        for task in list(self._tasks):
            task.cancel()
        for link in self._links.values():
            link.close()
        self._inbound.close()
        for extension in self._extensions.values():
            extension.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._segments is not None:
            self._segments.close()
        self.state = "closed"

    # -- outgoing calls ------------------------------------------------------------

    def resolve(self, to: str | int | WorkerInfo) -> WorkerAddress:
        """The worker named by a name, a rank or a WorkerInfo; raises UnknownWorkerError."""
        key = to.name if isinstance(to, WorkerInfo) else to
        found = self._by_rank.get(key) if isinstance(key, int) else self._workers.get(key)
        if found is None:
            known = ", ".join(sorted(self._workers)) or "none yet"
            raise UnknownWorkerError(
                f"worker {self.info.name!r} could not find destination {to!r}: no such worker "
                f"(known workers: {known})",
                worker=to,
            )
        return found

    def rpc_async(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...] | None = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        label: str | None = None,
    ) -> asyncio.Future[Any]:
        """Start a call; returns a future for its result.  Must run on the loop thread.

        ``label`` names the call in errors on both sides (default: the function's name).
        """
        self._check_usable()
        target = self.resolve(to)
        peer = target.name
        name = label or function_name(func)
        payload, buffers, reverts = dumps_for(
            self, target.rank, True, (func, args or (), kwargs or {})
        )
        link = self._links.get(peer)
        size = len(payload) + sum(b.nbytes for b in buffers)
        if size > (self.options.max_frame_size if link is None else link.max_send_size):
            undo(reverts)
            raise self._too_large(link, peer, name, size)
        call_id = next(self._ids)
        call = PendingCall(
            self._loop.create_future(),
            peer,
            name,
            self.options.timeout_for(timeout),
        )
        if call.timeout > 0:
            call.timer = self._loop.call_later(call.timeout, self._expire, call_id)
        self._pending[call_id] = call
        self._idle.clear()
        meta: dict[str, Any] = {"i": call_id, "f": name}
        context_values = carried()
        if context_values:
            meta["c"] = context_values
        notices = self._notices.take(peer)
        if notices:
            meta["n"] = notices
        request = OutgoingRequest(call_id, meta, payload, buffers, reverts)
        if link is not None and peer not in self._backlog:
            self._send_request(link, request)
        else:
            self._queue_behind_dial(peer, request)
        return call.future

    def _too_large(self, link: Link | None, peer: str, name: str, size: int) -> LocalProtocolError:
        """A call too large for the link's limits (ours alone while it is not dialed)."""
        ours = {self.info.name: self.options.max_frame_size}
        limits = link.max_frame_sizes if link is not None else ours
        what = f"call to {name} on worker {peer!r}"
        return too_large(what, size, limits, worker=peer, function=name)

    def notify(self, to: str | int | WorkerInfo, key: str, *args: Any) -> None:
        """Queue a one-way notice for a peer (see :mod:`asyncrpc.agent.notices`): it rides
        on our next request to that peer, or leaves on its own once the loop gets to it.
        Loop thread only."""
        self._check_usable()
        if self._notices.add(self.resolve(to).name, [key, *args]):
            self._loop.call_soon(self._send_notices)

    async def notices_delivered(self) -> None:
        """Wait until every peer sent a notice so far has handled it (a peer lost
        meanwhile has nothing left to handle)."""
        self._send_notices()
        told, self._notices.told = self._notices.told, set()
        answers = await asyncio.gather(
            *(self.rpc_async(peer, delivered) for peer in sorted(told)), return_exceptions=True
        )
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, ConnectionError):
                raise answer

    def _send_notices(self) -> None:
        for peer, notices in self._notices.take_all().items():
            link = self._links.get(peer)
            if link is not None:
                link.send(Kind.NOTICE, {"n": notices})
            else:
                self._spawn(self._send_notices_after_dial(peer, notices))

    async def _send_notices_after_dial(self, peer: str, notices: list[Any]) -> None:
        try:
            link = await self._connect(peer)
        except Exception as exc:  # a lost peer needs none of them any more
            log.debug("notices for %r dropped: %s", peer, exc)
            return
        link.send(Kind.NOTICE, {"n": notices})

    def _send_request(self, link: Link, request: OutgoingRequest) -> None:
        try:
            link.send(
                Kind.REQUEST,
                request.meta,
                request.payload,
                request.buffers,
                function=request.meta["f"],
            )
        except Exception as exc:  # e.g. too large a request: the call fails, visibly
            undo(request.undo)
            self._finish(request.call_id, error=exc)

    def _queue_behind_dial(self, peer: str, request: OutgoingRequest) -> None:
        backlog = self._backlog.get(peer)
        if backlog is None:
            backlog = self._backlog[peer] = []
            self._spawn(self._send_after_dial(peer))
        backlog.append(request)

    async def _send_after_dial(self, peer: str) -> None:
        """Send ``peer``'s backlog, in order, once its link is up (or fail it)."""
        try:
            link: Link | None = await self._connect(peer)
            error: Exception | None = None
        except Exception as exc:
            link, error = None, exc
        for request in self._backlog.pop(peer, []):
            if link is None:
                undo(request.undo)
                self._finish(request.call_id, error=error)
            elif request.call_id in self._pending:
                self._send_request(link, request)
            else:
                undo(request.undo)  # timed out while dialing: it never leaves

    async def _connect(self, peer: str) -> Link:
        link = self._links.get(peer)
        if link is not None:
            return link
        if peer not in self._dials:
            dialing = self._spawn(self._dial(peer))
            self._dials[peer] = dialing
            dialing.add_done_callback(lambda _: self._dials.pop(peer, None))
        return await asyncio.shield(self._dials[peer])

    async def _dial(self, peer: str) -> Link:
        target = self._workers[peer]
        address = self._choose_address(target)
        try:
            async with asyncio.timeout(self.options.connect_timeout):
                link = await dial(address, lambda: self._new_link(Role.DIALER), worker=peer)
                await link.ready
        except TimeoutError:
            raise PeerLostError(
                f"timed out connecting to worker {peer!r} at {address}", worker=peer
            ) from None
        except (ConnectionError, HandshakeError) as exc:
            if isinstance(exc, PeerLostError) and exc.details.get("worker") == peer:
                raise
            raise PeerLostError(
                f"cannot connect to worker {peer!r} at {address}: {exc}", worker=peer
            ) from exc
        if link.peer.name != peer:
            link.abort(PeerLostError(f"{address} is {link.peer.name!r}, not {peer!r}"))
            raise PeerLostError(f"worker {peer!r} is not at {address}", worker=peer)
        self._links[peer] = link
        return link

    def _choose_address(self, target: WorkerAddress) -> str:
        same_host = target.host == self.identity.host
        for scheme in self.options.transports:
            if scheme in target.addresses and (scheme != "unix" or same_host):
                return target.addresses[scheme]
        raise PeerLostError(f"no common transport with worker {target.name!r}", worker=target.name)

    def _expire(self, call_id: int) -> None:
        call = self._pending.get(call_id)
        if call is None:
            return
        link = self._links.get(call.peer)
        if link is not None:
            link.send(Kind.CANCEL, {"i": call_id})
        self._finish(
            call_id,
            error=RPCTimeoutError(
                f"call to {call.function} on worker {call.peer!r} timed out after {call.timeout}s",
                worker=call.peer,
                function=call.function,
            ),
        )

    def _finish(
        self, call_id: int, *, result: Any = None, error: BaseException | None = None
    ) -> None:
        call = self._pending.pop(call_id, None)
        if call is None:
            return
        if call.timer is not None:
            call.timer.cancel()
        if not call.future.done():
            if error is None:
                call.future.set_result(result)
            else:
                call.future.set_exception(error)
        if not self._pending:
            self._idle.set()

    def _on_reply(self, link: Link, frame: Frame) -> None:
        call_id = frame.meta.get("i")
        if type(call_id) is not int:
            return
        call = self._pending.get(call_id)
        if call is None or call.peer != link.peer.name:
            return  # a late reply to a call that already timed out
        try:
            value = loads_from(self, link.peer.rank, False, frame.payload, frame.buffers)
            if frame.kind == Kind.RESPONSE:
                self._finish(call_id, result=value)
            else:
                self._finish(call_id, error=unpack_error(value))
        except SerializationError as exc:
            self._finish(
                call_id,
                error=SerializationError(
                    f"reply of {call.function} from worker {call.peer!r}: {exc}",
                    worker=call.peer,
                    function=call.function,
                ),
            )

    # -- link events ---------------------------------------------------------------

    def _new_link(self, role: Role) -> Link:
        handshake = Handshake(
            role, self._secret, self.identity, max_frame_size=self.options.max_frame_size
        )
        return Link(
            self,
            handshake,
            allocate=allocate_tensor_storage,
            segments=self._segments,
            max_mapped_bytes=self.options.shared_memory_budget,
            handshake_timeout=self.options.handshake_timeout,
        )

    def _inbound_link(self) -> asyncio.BaseProtocol:
        return self._admission.admit(lambda: self._new_link(Role.LISTENER))

    def link_established(self, link: Link) -> None:
        if link.handshake.role is Role.LISTENER:
            self._admission.settled(link)
            self._inbound.add_link(link)

    def frame_received(self, link: Link, frame: Frame) -> None:
        if self._early_frames is not None:  # not joined yet: handled in join()
            self._early_frames.append((link, frame))
            return
        self._poller.kick()
        notices = frame.meta.get("n")
        if notices is not None:
            handle(self, link.peer.rank, notices)
        kind = frame.kind
        if kind == Kind.REQUEST:
            self._inbound.on_request(link, frame)
        elif kind in (Kind.RESPONSE, Kind.ERROR):
            self._on_reply(link, frame)
        elif kind == Kind.CANCEL:
            self._inbound.on_cancel(link, frame)
        elif kind == Kind.SHUTDOWN:
            self._on_shutdown_notice(link, frame.meta.get("phase"))

    def frames_sent(self, link: Link) -> None:
        self._poller.kick()  # a request or a reply left: an answer, or the next call, may follow

    def link_lost(self, link: Link, exc: BaseException) -> None:
        self._admission.settled(link)
        self._inbound.drop_link(link)
        peer = link.handshake.peer
        if (
            peer is not None
            and link.handshake.established
            and self.state in ("running", "draining")
        ):
            for extension in list(self._extensions.values()):
                extension.peer_lost(peer.rank)
        if peer is None:
            return
        if self._links.get(peer.name) is not link:  # an inbound link: dead if it was the last
            if link.handshake.established and self._no_link_with(peer.name):
                self._mark_dead(peer.name)
            return
        del self._links[peer.name]
        self._mark_dead(peer.name)
        lost = PeerLostError(f"lost connection to worker {peer.name!r}: {exc}", worker=peer.name)
        lost.__cause__ = exc
        for call_id, call in list(self._pending.items()):
            if call.peer == peer.name:
                self._finish(call_id, error=lost)

    def _no_link_with(self, name: str) -> bool:
        return name not in self._links and self._inbound.link_from(name) is None

    def _mark_dead(self, name: str) -> None:
        if name not in self._peers_done[2] and self.state in ("draining", "running"):
            self._dead.add(name)
            self._barrier_changed.set()

    # -- introspection and helpers -------------------------------------------------

    def debug_info(self) -> dict[str, Any]:
        """Pending outgoing calls, running incoming calls, connected peers and more."""
        peers = self._inbound.peers | set(self._links)
        info: dict[str, Any] = {
            "worker": self.info.name,
            "rank": self.info.id,
            "state": self.state,
            "pending_outgoing_calls": len(self._pending),
            "queued_notices": len(self._notices),
            "running_incoming_calls": self._inbound.running,
            "connected_peers": sorted(peers),
            "pending_handshakes": self._admission.pending,
            "refused_connections": self._admission.refused,
            "dead_peers": sorted(self._dead),
            "shared_memory": self._shared_memory_info(),
        }
        for extension in self._extensions.values():
            info.update(extension.debug_info())
        return info

    def _shared_memory_info(self) -> dict[str, int] | None:
        """Our segment pool's figures, and how much of peers' segments we keep mapped."""
        if self._segments is None:
            return None
        links = [*self._links.values(), *self._inbound.links]
        return {**self._segments.stats, "mapped_bytes": sum(link.mapped_bytes for link in links)}

    def run_blocking(self, start: Callable[[], Awaitable[T]], limit: float, what: str) -> T:
        """From another thread: run ``start()`` on the loop and wait for it (the
        blocking form of a call).  ``limit`` (seconds, 0: none) bounds the wait; ``what``
        names the call in errors.  On the loop thread it raises instead of deadlocking."""
        if self._loop.is_running() and _on_loop_thread(self._loop):
            raise AgentStateError(
                f"{what} was called on the event loop thread, where it would deadlock; "
                "await the async form there"
            )

        async def run() -> T:
            return await start()

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return future.result(timeout=limit + 5.0 if limit > 0 else None)
        except TimeoutError as exc:
            if isinstance(exc, RPCTimeoutError):
                raise
            future.cancel()
            raise RPCTimeoutError(f"{what} got no answer in {limit}s") from None

    def extension(self, key: str, create: Callable[[RpcAgent], E]) -> E:
        """The extension registered under ``key``, made by ``create(self)`` on first use."""
        found = self._extensions.get(key)
        if found is None:
            found = self._extensions[key] = create(self)
        return found  # type: ignore[return-value]  # one key, one type, by convention

    def invoke(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> asyncio.Future[Any]:
        """Run ``func`` here, placed as an incoming call would be (thread pool, loop task,
        awaitable or inline); returns a future of its result."""
        return self._inbound.invoke(func, args, kwargs or {})

    def offload(self, kind: Hashable, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run the framework's own compute ``func(*args)``: on the loop if the last job of
        ``kind`` proved quick, else in the thread pool (see :mod:`asyncrpc.agent.inbound`)."""
        return self._inbound.offload(kind, func, *args)

    def _worth_polling(self) -> bool:
        """Spin while calls are in flight, unless slow pool jobs or copies into shared
        memory need the CPU (a spinning loop starved them, and they it: 20 x 64 MiB
        calls saw the loop wake up to 130 ms late)."""
        copying = self._segments.copying if self._segments is not None else 0
        return self.state != "closed" and self._inbound.slow_threads_busy == 0 and not copying

    def _check_usable(self) -> None:
        if self.state not in ("running", "draining"):
            raise AgentStateError(f"RPC agent of {self.info.name!r} is {self.state}")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro, context=self._context.copy())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop


def _busy(exc: BaseException) -> bool:
    """Whether a failed dial reached a live worker that did not answer in time."""
    cause = exc.__cause__
    return isinstance(cause, HandshakeError) and bool(cause.details.get("timed_out"))


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False


_default: RpcAgent | None = None


def current_agent() -> RpcAgent | None:
    """The agent serving the running call, else this process's default agent."""
    return _current.get(_default)


def set_default_agent(agent: RpcAgent | None) -> None:
    """Make ``agent`` what :func:`current_agent` returns outside of calls."""
    global _default
    _default = agent
