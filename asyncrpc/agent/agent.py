"""The per-worker RPC agent: peers, pending calls, deadlines, dispatch, shutdown.

Theory of operation
-------------------
A worker listens on every transport it offers and dials a peer on first use,
on the route :mod:`asyncrpc.agent.routes` plans: unix sockets only to a peer of
our network namespace, and tcp at once, for good, if nobody answers there.  The
debug info's ``links`` says which transport each link uses, and why.
Links are one-way for calls: requests go out on links we dialed and come in on
links peers dialed; each request's reply returns on the link it came in on.  So
two workers that call each other hold two links, and no tie-break is needed.

Outgoing: ``rpc_async`` serialises at once (a bad argument raises right there),
records a :class:`PendingCall` and its deadline (:mod:`asyncrpc.agent.deadlines`:
one loop timer for all of them), and writes the request
(or queues it behind the dial, with any NOTICE frame made meanwhile).  The
request is an :class:`~asyncrpc.agent.outgoing.Outgoing`: if it never leaves,
what its serialisation did is undone and the notices it carried go first with
what follows.  A plain request (see :mod:`asyncrpc.agent.transfer`) has nothing
to undo: with no notices to carry and its link up, it is written as it is.
Tensor bytes are never copied on the loop: a large buffer for
a same-host peer is copied into shared memory by the Link's copier threads, in
order with the link's other messages, within this worker's shared-memory
budget (``shared_memory_budget``; beyond it the bytes go through the socket).
The debug info reports the pool and the peers' segments we map.  The call
ends exactly once: by its reply, by its deadline (``RPCTimeoutError``,
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
still talks to it.  Then close.  Who announced what and who is dead is the
sans-IO :class:`~asyncrpc.agent.shutdown.ShutdownBarrier`'s; the agent feeds it
events (a SHUTDOWN frame, a link established or lost, a dial's outcome) and
carries out its actions (reach a peer, tell a link, a phase passed).  Each dial
is bounded by ``connect_timeout``; a call that fails because its dial failed says
so (``PeerLostError`` with ``sent=False``: it never left, so it may go elsewhere).

Partitions: a tcp link whose peer stays silent for ``silent_peer_timeout`` is
dropped by the kernel (:mod:`asyncrpc.transport.liveness`), so calls in flight fail
with ``PeerLostError`` instead of waiting out their timeout.  Once contact with a peer
is lost (a link lost, a dial failed), the connect of each dial to it is bounded by
``redial_timeout`` rather than ``connect_timeout``, until a dial succeeds
(:meth:`~asyncrpc.agent.routes.Routes.lost`): while the partition lasts new calls fail
within it, and the first call after it heals dials afresh and goes through.  Being
lost does not stop a peer from being dialed or heard again: a new link with it makes it
alive again before shutdown, and the shutdown barrier reaches every peer anew at each
phase (a partition during shutdown counts as death: docs/deploy.md).
``shutdown(timeout=...)`` bounds the whole.
Unbounded by design: ``shutdown(timeout=None)`` waits in phase 1 for live peers
as long as they live (and for our own calls, each bounded by its timeout unless
it has none), and ``timeout=0`` waits without a bound throughout.

Extensions: upper layers (RRefs, distributed autograd) attach one object each
with :meth:`RpcAgent.extension`; the agent tells them of lost peers, lets them
drain before the shutdown barrier, closes them, and merges their debug info.
Lower layers stay ignorant of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from asyncrpc.agent import spans
from asyncrpc.agent.deadlines import Deadlines
from asyncrpc.agent.dispatch import function_name, unpack_error
from asyncrpc.agent.inbound import Inbound
from asyncrpc.agent.metrics import call_metrics, outcome_of
from asyncrpc.agent.notices import (
    Notice,
    Notices,
    delivered,
    fits_a_request,
    handle,
    in_frames,
)
from asyncrpc.agent.outgoing import Outgoing, send_unless_lost
from asyncrpc.agent.polling import BusyPoller, oversubscribed
from asyncrpc.agent.routes import Routes
from asyncrpc.agent.shutdown import (
    PHASES,
    Lifecycle,
    Passed,
    Reach,
    ShutdownBarrier,
    Tell,
)
from asyncrpc.agent.shutdown import Action as ShutdownAction
from asyncrpc.agent.transfer import (
    BY_NAME,
    PLAIN,
    TENSORS,
    carried,
    dumps_reply,
    dumps_request,
    loads_reply,
    loads_request,
)
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
from asyncrpc.serde import allocate_tensor_storage, cuda, dumps_plain
from asyncrpc.serde.devices import (
    CudaRoute,
    DeviceMap,
    WorkerDevices,
    devices_used,
    route,
)
from asyncrpc.serde.references import reference
from asyncrpc.transport import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_IDLE,
    DEFAULT_SILENT_PEER_TIMEOUT,
    DEFAULT_STRIPES,
    KERNEL,
    MAX_STRIPES,
    MEMORY,
    SCHEMES,
    Admission,
    Host,
    Link,
    SegmentPool,
    StripeListener,
    dial,
    host_of,
    listen,
    local_host,
    too_large,
)
from asyncrpc.transport.storage import StoragePool
from asyncrpc.wire import DEFAULT_MAX_FRAME_SIZE, Frame, Handshake, Identity, Kind, Role
from asyncrpc.wire.messages import ERROR, REQUEST, RESPONSE

log = logging.getLogger("asyncrpc.agent")
DEFAULT_BUSY_POLL = 300e-6  # seconds; see asyncrpc.agent.polling
# Kinds every frame is compared with, as plain ints (an IntEnum member's lookup costs
# several times an int's, on every frame).
_REPLIES = frozenset((RESPONSE, ERROR))
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
    listen_port: int = 0  # the tcp port to listen on (0: any free one)
    shared_memory: bool = True
    shared_memory_budget: int = DEFAULT_BUDGET
    shared_memory_idle: int = DEFAULT_MAX_IDLE
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    connect_timeout: float = 30.0
    redial_timeout: float = 1.0  # a connect to a peer we lost contact with
    handshake_timeout: float = 10.0
    silent_peer_timeout: float = DEFAULT_SILENT_PEER_TIMEOUT  # tcp; 0: kernel defaults
    busy_poll: float | None = None  # None: DEFAULT_BUSY_POLL while this host has a CPU each
    max_running_per_link: int = 4096
    max_pending_handshakes: int = 64  # inbound connections authenticating at once
    tcp_stripes: int = DEFAULT_STRIPES  # side connections per tcp link (0: none)
    devices: tuple[str, ...] = ()  # CUDA devices this worker uses (empty: from the maps)
    device_maps: dict[str, DeviceMap] = field(default_factory=dict)  # normalised

    def timeout_for(self, timeout: float | None) -> float:
        """A call's timeout in seconds, as torch reads it: None or negative (torch's
        ``UNSET_RPC_TIMEOUT``, -1) means ``rpc_timeout``; 0 means none."""
        return self.rpc_timeout if timeout is None or timeout < 0 else timeout

    def __post_init__(self) -> None:
        if self.shared_memory_budget < 0 or self.shared_memory_idle < 0:
            raise ValueError("shared_memory_budget and shared_memory_idle must be >= 0")
        if self.silent_peer_timeout < 0 or self.redial_timeout <= 0:
            raise ValueError("silent_peer_timeout must be >= 0 and redial_timeout > 0")
        if not 0 <= self.tcp_stripes <= MAX_STRIPES:
            raise ValueError(f"tcp_stripes must be between 0 and {MAX_STRIPES}")
        unknown = [t for t in self.transports if t not in SCHEMES]
        if unknown or not self.transports:
            raise ValueError(
                f"transports {list(self.transports)}: each must be one of {sorted(SCHEMES)}"
            )


class CallFuture(asyncio.Future[Any]):
    """The future of an outgoing call.  Cancelling it (``asyncio.wait_for`` or
    ``asyncio.timeout`` running out, a cancelled task awaiting it) cancels the call, as
    its deadline would: the callee is told, and the call is no longer pending."""

    __slots__ = ("_agent", "_call_id")
    _agent: RpcAgent  # (set by RpcAgent._pend: an __init__ of ours would double the cost
    _call_id: int  # of making one, on every call)

    def cancel(self, msg: Any | None = None) -> bool:
        if not super().cancel(msg):
            return False
        self._agent._call_cancelled(self._call_id)
        return True


@dataclass(slots=True)
class PendingCall:
    future: asyncio.Future[Any]
    peer: str
    function: str
    timeout: float
    started: float  # perf_counter() when rpc_async was called
    span: Any = None  # its span in a torch.profiler trace, while one runs (see spans)


class RpcAgent:
    """One worker's agent.  Create, ``await start()``, ``join(workers)``, use, ``shutdown``."""

    def __init__(self, name: str, rank: int, secret: bytes, options: AgentOptions) -> None:
        self.options = options
        self.info = WorkerInfo(rank, name)
        self.host = local_host()
        self.identity = Identity(name, rank, os.getpid(), str(self.host))
        self.address = WorkerAddress(name, rank, self.identity.host)
        self._secret = secret
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()
        self._context.run(_current.set, self)
        self._poller = BusyPoller(0.0, self._worth_polling)  # its window is set in join()
        self.metrics = call_metrics()
        self._bytes_of_lost_links: dict[str, dict[str, int]] = {}
        self._inbound = Inbound(
            name,
            self._context,
            options.num_worker_threads,
            options.max_running_per_link,
            loads_request=functools.partial(loads_request, self),
            dumps_reply=functools.partial(dumps_reply, self),
            metrics=self.metrics,
        )
        self._extensions: dict[str, Extension] = {}
        self._segments = (
            SegmentPool(options.shared_memory_budget, options.shared_memory_idle)
            if options.shared_memory
            else None
        )
        # large buffers received through a socket land in warm, reused memory
        self._storage = StoragePool(allocate_tensor_storage)
        self._workers: dict[str, WorkerAddress] = {}
        self._by_rank: dict[int, WorkerAddress] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._stripe_listener: StripeListener | None = None  # tcp links' side connections
        self._admission = Admission(options.max_pending_handshakes)
        self._links: dict[str, Link] = {}  # outgoing, by peer name
        self._routes = Routes(options.transports, self.host)  # how each peer is dialed
        self._dials: dict[str, asyncio.Future[Link]] = {}
        self._devices: dict[str, WorkerDevices] = {}  # each worker's CUDA devices and maps
        self._cuda_routes: dict[tuple[int, bool], CudaRoute] = {}
        # Messages waiting for a peer's link (or for their CUDA copies), in order: one
        # task sends them all once they can go, so no later message overtakes them.
        self._backlog: dict[str, list[Outgoing]] = {}
        self._pending: dict[int, PendingCall] = {}
        self._deadlines = Deadlines(self._loop, self._expire, self._pending)
        self._notices = Notices()
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Future[Any]] = set()
        # Set when no call of ours is pending, for whoever waits for that (shutdown):
        # made on demand, so that a call costs no Event.set and clear.
        self._idle: asyncio.Future[None] | None = None
        self.store: object = None  # the rendezvous store, kept alive (it may host a TCPStore)
        self._shutdown: ShutdownBarrier[Link] = ShutdownBarrier(())  # with the peers: join()
        self._phase_passed = {phase: asyncio.Event() for phase in PHASES}
        # Frames that arrive before join(): a peer that finished the rendezvous first may
        # call us already, and our calls' handlers need to know every worker.
        self._early_frames: list[tuple[Link, Frame]] | None = []
        self.state = Lifecycle.NEW
        self.closing_debug_info: dict[str, Any] = {}

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> WorkerAddress:
        """Listen on every configured transport; returns the address to publish."""
        addresses = {}
        unique = f"asyncrpc-{self.identity.pid}-{id(self):x}"
        for scheme in self.options.transports:
            target = SCHEMES[scheme].listen_target(
                self.options.listen_host, unique, self.options.listen_port
            )
            try:
                server, bound = await listen(target, self._inbound_link)
            except OSError as exc:
                for started in self._servers:
                    started.close()
                raise OSError(
                    exc.errno, f"worker {self.info.name!r} cannot listen on {target}: {exc}"
                ) from exc
            self._servers.append(server)
            addresses[scheme] = bound
        if "tcp" in addresses and self.options.tcp_stripes:
            self._stripe_listener = StripeListener(
                host_of(addresses["tcp"]),
                self.options.tcp_stripes,
                timeout=self.options.handshake_timeout,
            )
        self.address = WorkerAddress(self.info.name, self.info.id, self.identity.host, addresses)
        self.state = Lifecycle.LISTENING
        return self.address

    def join(
        self, workers: list[WorkerAddress], devices: dict[str, WorkerDevices] | None = None
    ) -> None:
        """Learn every worker of the job and their CUDA devices and maps (from
        rendezvous, checked); calls may start."""
        self._devices = devices or {}
        self._workers = {w.name: w for w in workers}
        self._by_rank = {w.rank: w for w in workers}
        self._poller.window = self._busy_poll_window(workers)
        crowded = oversubscribed(
            self._workers_here(workers), torch.get_num_threads(), len(os.sched_getaffinity(0))
        )
        if crowded is not None:
            log.warning("worker %r: %s", self.info.name, crowded)
        self._shutdown = ShutdownBarrier(name for name in self._workers if name != self.info.name)
        self.state = Lifecycle.RUNNING
        early, self._early_frames = self._early_frames or [], None
        for link, frame in early:
            if not link.closed:
                self.frame_received(link, frame)

    @property
    def my_devices(self) -> WorkerDevices:
        """This worker's CUDA devices and maps, as published at rendezvous."""
        return WorkerDevices(
            self.info.name,
            cuda.device_count(),
            self.options.devices,
            self.options.device_maps,
        )

    def cuda_route(self, peer_rank: int, *, reply: bool) -> CudaRoute:
        """Where the CUDA tensors of a request (or a reply) to ``peer_rank`` land, and
        whether they may travel by CUDA IPC (see :mod:`asyncrpc.serde.devices`)."""
        key = (peer_rank, reply)
        found = self._cuda_routes.get(key)
        if found is None:
            peer = self._by_rank[peer_rank]
            found = self._cuda_routes[key] = route(
                self._devices.get(self.info.name) or self.my_devices,
                self._devices.get(peer.name) or WorkerDevices(peer.name, 0),
                reply=reply,
                same_host=self.options.shared_memory
                and self.host.refusal(Host.parse(peer.host), MEMORY) is None,
            )
        return found

    def _cuda_info(self) -> dict[str, Any]:
        """CUDA devices, maps, the path to each peer, and tensors sent and received."""
        me = self._devices.get(self.info.name)
        if me is None or not (me.maps or any(w.maps for w in self._devices.values())):
            return {"devices": [], "device_maps": {}, **cuda.stats()}
        paths = {}
        for peer in sorted(self._workers):
            if peer != self.info.name:
                ipc = self.cuda_route(self._workers[peer].rank, reply=False).ipc
                paths[peer] = "cuda ipc" if ipc else "host staging"
        used = devices_used(self.info.name, self._devices)
        return {"devices": list(used), "device_maps": dict(me.maps), "paths": paths, **cuda.stats()}

    def _busy_poll_window(self, workers: list[WorkerAddress]) -> float:
        """The configured window; by default, polling only while every worker of this
        host can have a CPU of its own (a spinning loop takes one from a busy peer)."""
        if self.options.busy_poll is not None:
            return self.options.busy_poll
        here = self._workers_here(workers)
        return DEFAULT_BUSY_POLL if here <= len(os.sched_getaffinity(0)) else 0.0

    def _workers_here(self, workers: list[WorkerAddress]) -> int:
        """How many of ``workers`` (this one included) run on this host's kernel."""
        return sum(1 for w in workers if self.host.refusal(Host.parse(w.host), KERNEL) is None)

    async def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Leave the job.  Graceful: wait for our calls and for every live peer to call
        shutdown too, then release what they share (RRefs, contexts) and close.

        ``timeout=None``: wait for the others as long as they are alive (a worker that
        only serves calls shutdown at once and waits out the job, as in torch), then
        bound the release by ``rpc_timeout``.  A number bounds the whole of it; 0 or
        less means no bound at all.
        """
        if self.state.ending:
            return
        try:
            if graceful and self.state is Lifecycle.RUNNING:
                if timeout is None:
                    await self._arrive()
                    await self._within(self.options.rpc_timeout, self._depart())
                else:
                    await self._within(timeout, self._arrive_and_depart())
        finally:
            await self._close()

    async def _arrive(self) -> None:
        """Our calls are done and every live peer has called shutdown."""
        await self._calls_ended()  # each call is bounded by its own timeout
        await self._barrier(1)  # a peer that dies is skipped

    async def _depart(self) -> None:
        """Extensions release what peers share, and we let go of the CUDA memory peers
        shared; then all meet again and may close (and free what they let go of)."""
        for extension in list(self._extensions.values()):
            await extension.drain()
        await self._calls_ended()
        await self._let_go_of_peers_memory()
        await self._barrier(2)

    async def _let_go_of_peers_memory(self) -> None:
        """Until the peers' memory kept open here by CUDA IPC is let go, so that each
        peer frees what it sent before it exits (see ``serde.cuda.let_go_of_peers``)."""
        released = cuda.let_go_of_peers()
        if released is not None:
            await asyncio.wrap_future(released)

    async def _calls_ended(self) -> None:
        """Until no call of ours is pending."""
        if self._pending:
            if self._idle is None:
                self._idle = self._loop.create_future()
            await asyncio.shield(self._idle)  # (one waiter's cancellation is its own)

    async def _arrive_and_depart(self) -> None:
        await self._arrive()
        await self._depart()

    async def _within(self, bound: float, step: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(bound if bound > 0 else None):
                await step
        except TimeoutError:
            raise RPCTimeoutError(
                f"shutdown of {self.info.name!r} timed out after {bound}s: {self._give_up()}"
            ) from None

    def _give_up(self) -> str:
        """The time ran out: end the barrier; what we were still waiting for."""
        gave_up = self._shutdown.give_up()
        if self._pending:
            calls = sorted({f"{c.function} on {c.peer!r}" for c in self._pending.values()})
            return f"{len(self._pending)} of our calls still pending ({', '.join(calls[:5])})"
        if gave_up.phase == 1:
            return f"workers that have not called shutdown: {list(gave_up.missing)}"
        return f"workers still releasing their RRefs and the like: {list(gave_up.missing)}"

    # -- shutdown barrier: the driver of asyncrpc.agent.shutdown ---------------------

    async def _barrier(self, phase: int) -> None:
        """Tell every peer we reached ``phase``; wait until each has too, or is dead."""
        self.state = Lifecycle.DRAINING
        self._carry_out(self._shutdown.start(phase))
        await self._phase_passed[phase].wait()  # bounded by shutdown(), see its docstring

    def _carry_out(self, actions: list[ShutdownAction[Link]]) -> None:
        for action in actions:
            if isinstance(action, Reach):
                self._spawn(self._reach(action.peer))
            elif isinstance(action, Tell):
                self._tell(action.link, action.phases)
            elif isinstance(action, Passed):
                self._phase_passed[action.phase].set()

    async def _reach(self, name: str) -> None:
        """Report a link shared with ``name`` to the barrier: any, inbound included (a
        peer whose loop is busy cannot complete a new handshake, but reads an open link
        once free); without one we dial (each dial bounded by ``connect_timeout``)."""
        link = self._links.get(name) or self._inbound.link_from(name)
        if link is None:
            try:
                link = await self._connect(name)
            except Exception as exc:  # PeerLostError or TimeoutError, as a rule
                log.debug("shutdown could not dial %r: %r", name, exc)
                self._carry_out(self._shutdown.dial_failed(name, busy=_busy(exc)))
                return
        self._carry_out(self._shutdown.reached(name, link))

    def _tell(self, link: Link, phases: tuple[int, ...]) -> None:
        """SHUTDOWN for each phase, after the notices queued for the peer (so a worker
        that has seen our SHUTDOWN has handled every notice we sent before it)."""
        for notices in in_frames(link.peer.name, self._notices.take(link.peer.name)):
            self._write(link, self._notice_message(link.peer.name, notices))
        for phase in phases:
            link.send(Kind.SHUTDOWN, {"rank": self.info.id, "phase": phase})

    def _on_shutdown_notice(self, link: Link, phase: Any) -> None:
        self._carry_out(self._shutdown.peer_announced(link.peer.name, phase, link))

    async def _close(self) -> None:
        self.closing_debug_info = self.debug_info()  # what was left: leaks show here
        self.state = Lifecycle.CLOSING
        self._shutdown.give_up()  # the barrier is over: no more reaching or telling
        for server in self._servers:
            server.close()
        if self._stripe_listener is not None:
            self._stripe_listener.close()
        closed = AgentStateError(f"worker {self.info.name!r} shut down")
        for call_id in list(self._pending):
            self._finish(call_id, error=closed)
        self._deadlines.close()
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
        self._storage.close()
        cuda.let_go_of_peers()  # (not waited for; after a graceful one: what came since)
        cuda.collect_released()  # (our peers let go of it before their last barrier)
        self.state = Lifecycle.CLOSED

    # -- outgoing calls ------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerInfo]:
        """Every worker of the job (this one included), by rank."""
        return sorted((w.info for w in self._workers.values()), key=lambda info: info.id)

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
        call_id = next(self._ids)
        # The function by name beside the arguments, if it has one (serde.references).
        by_name = reference(func)
        value = (args or (), kwargs or {}) if by_name else (func, args or (), kwargs or {})
        # A plain value's payload; else reducers take part, and an Outgoing owns their effects.
        try:
            request: bytes | Outgoing | None = dumps_plain(value)
            if request is None:
                request = dumps_request(self, target.rank, value, call_id=call_id, function=name)
        except SerializationError as exc:  # say which call, as the callee does of a result
            raise SerializationError(
                f"call to {name} on worker {peer!r} cannot be sent: {exc}",
                worker=peer,
                function=name,
            ) from exc
        link = self._links.get(peer)
        size = len(request) if isinstance(request, bytes) else request.size
        if size > (self.options.max_frame_size if link is None else link.max_send_size):
            if isinstance(request, Outgoing):
                request.abandon()
            raise self._too_large(link, peer, name, size)
        meta = {"i": call_id, "f": name} if isinstance(request, bytes) else request.meta
        if by_name:
            meta[BY_NAME] = by_name
        context_values = carried()
        if context_values:
            meta["c"] = context_values
        notices = self._notices.take(peer)
        if notices and not fits_a_request(notices):  # they leave ahead of it, in order
            self._send_notice_frames(peer, notices)
            notices = []
        if isinstance(request, bytes):  # plain: nothing to undo or stage
            meta[PLAIN] = True
            if not notices and link is not None and peer not in self._backlog:
                return self._write_plain(link, peer, call_id, meta, request, timeout=timeout)
            request = Outgoing(Kind.REQUEST, meta, request, function=name)
        if notices:
            request.carry(notices, functools.partial(self._notices.give_back, peer))
        future = self._pend(call_id, peer, name, timeout)
        self._send(peer, request)
        return future

    def _pend(
        self,
        call_id: int,
        peer: str,
        name: str,
        timeout: float | None,
        started: float | None = None,
    ) -> asyncio.Future[Any]:
        """Record call ``call_id`` as pending, with its deadline; the future of its result.
        ``started``: when it was sent, if it already was (default: now)."""
        future = CallFuture(loop=self._loop)
        future._agent, future._call_id = self, call_id
        call = PendingCall(
            future,
            peer,
            name,
            self.options.timeout_for(timeout),
            time.perf_counter() if started is None else started,
        )
        if spans.profiling():
            call.span = spans.begin_call(name, peer, call_id, self.info.name)
        self._pending[call_id] = call
        if call.timeout > 0:
            self._deadlines.add(call_id, call.timeout)
        return call.future

    def _write_plain(
        self,
        link: Link,
        peer: str,
        call_id: int,
        meta: dict[str, Any],
        payload: bytes,
        *,
        timeout: float | None,
    ) -> asyncio.Future[Any]:
        """Write a plain request that carries no notices, then record it as pending: that
        bookkeeping runs while the request travels (its reply is read on a later turn of
        this loop, never before).  If the link refuses it, the call fails with the link's
        error (nothing to undo or give back).  The future of its result."""
        name = meta["f"]
        started = time.perf_counter()
        error: Exception | None = None
        try:
            send_unless_lost(link, REQUEST, meta, payload, function=name)
        except Exception as exc:
            error = exc
        future = self._pend(call_id, peer, name, timeout, started)
        if error is not None:
            self._finish(call_id, error=error)
        return future

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
        """Everything queued leaves now, in NOTICE frames (one per peer, as a rule)."""
        for peer, notices in self._notices.take_all().items():
            self._send_notice_frames(peer, notices)

    def _send_notice_frames(self, peer: str, notices: list[Notice]) -> None:
        for run in in_frames(peer, notices):
            self._send(peer, self._notice_message(peer, run))

    def _notice_message(self, peer: str, notices: list[Notice]) -> Outgoing:
        """A NOTICE frame carrying ``notices``; they are given back if it never leaves."""
        message = Outgoing(Kind.NOTICE, {})
        message.carry(notices, functools.partial(self._notices.give_back, peer))
        return message

    def _send(self, peer: str, message: Outgoing) -> None:
        """Write ``message`` now if ``peer``'s link is up and nothing waits for it, else
        queue it behind the dial."""
        link = self._links.get(peer)
        if link is not None and peer not in self._backlog and message.ready:
            self._write(link, message)
        else:
            self._queue_behind_dial(peer, message)

    def _write(self, link: Link, message: Outgoing) -> None:
        try:
            message.send_on(link)
        except Exception as exc:  # e.g. too large a request: the call fails, visibly
            self._drop(message, exc, link)

    def _drop(self, message: Outgoing, error: Exception | None, link: Link | None) -> None:
        """``message`` never leaves: it is abandoned, and its call fails with ``error``
        (None: it has ended already).  The notices it carried go now if ``link`` is
        up, ahead of anything later."""
        message.abandon()
        if error is not None and message.call_id is not None:
            self._finish(message.call_id, error=error)
        if link is not None:
            self._send_given_back(link)

    def _send_given_back(self, link: Link) -> None:
        """The notices given back for ``link``'s peer, in a NOTICE frame, now."""
        peer = link.peer.name
        for notices in in_frames(peer, self._notices.take_returned(peer)):
            try:
                link.send(Kind.NOTICE, {"n": notices})
            except LocalProtocolError as exc:  # (each run fits a frame: not expected)
                log.error("notices for %r dropped: %s", peer, exc)

    def _queue_behind_dial(self, peer: str, message: Outgoing) -> None:
        backlog = self._backlog.get(peer)
        if backlog is None:
            backlog = self._backlog[peer] = []
            self._spawn(self._send_after_dial(peer))
        backlog.append(message)

    async def _send_after_dial(self, peer: str) -> None:
        """Send ``peer``'s backlog, in order, once its link is up and each message is
        ready (its CUDA copies done); or fail it.  A peer that cannot be reached
        (unlike a busy one) has no use for notices any more."""
        try:
            link = await self._connect(peer)
        except Exception as exc:
            for message in self._backlog.pop(peer, []):
                self._drop(message, exc, None)
            if not _busy(exc):
                self._notices.forget(peer)
            return
        backlog = self._backlog[peer]
        while backlog:  # (messages queued meanwhile join the end)
            message = backlog[0]
            try:
                await message.wait_staged()
            except Exception as exc:  # a CUDA error: this call fails, the others go on
                self._drop(backlog.pop(0), exc, link)
                continue
            backlog.pop(0)
            if message.call_id is None or message.call_id in self._pending:
                self._write(link, message)
            else:  # its call timed out while dialing
                self._drop(message, None, link)
        del self._backlog[peer]

    async def connect_peers(self, within: float) -> None:
        """Dial every other worker now, as torch's agent does during its init, so that a
        first call does not pay for the connection: wait at most ``within`` seconds (the
        rest go on in the background).  A dial that fails is no error here: a call to
        that peer fails, or dials again, as it would have."""
        dials = [
            self._spawn(self._connect(peer)) for peer in self._workers if peer != self.info.name
        ]
        for dialing in dials:
            dialing.add_done_callback(_quietly)
        if dials:
            await asyncio.wait(dials, timeout=within)

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
        """A link to ``peer`` on the first route of our plan that answers (a scoped one
        that nobody answers is remembered, and the next one dialed at once)."""
        target = self._workers[peer]
        while True:
            route, *fallbacks = self._routes.plan(target)
            try:
                link = await self._dial_route(peer, route.address)
            except PeerLostError as exc:
                if not fallbacks or not exc.details.get("unreachable"):
                    self._routes.lost(peer, str(exc))
                    raise
                self._routes.refused(peer, route, exc)
                log.warning("%s; dialing worker %r on %s", exc, peer, fallbacks[0].scheme)
                continue
            self._routes.chosen(peer, route)
            return link

    async def _dial_route(self, peer: str, address: str) -> Link:
        try:
            async with asyncio.timeout(self.options.connect_timeout):
                link = await self._open(peer, address)
                await link.ready
        except TimeoutError:
            raise PeerLostError(
                f"timed out connecting to worker {peer!r} at {address}", worker=peer, sent=False
            ) from None
        except (ConnectionError, HandshakeError) as exc:
            if isinstance(exc, PeerLostError) and exc.details.get("worker") == peer:
                exc.details["sent"] = False  # nothing goes out before the dial
                raise
            raise PeerLostError(
                f"cannot connect to worker {peer!r} at {address}: {exc}", worker=peer, sent=False
            ) from exc
        if link.peer.name != peer:
            link.abort(PeerLostError(f"{address} is {link.peer.name!r}, not {peer!r}"))
            raise PeerLostError(f"worker {peer!r} is not at {address}", worker=peer, sent=False)
        self._links[peer] = link
        return link

    async def _open(self, peer: str, address: str) -> Link:
        """Connect to ``address`` (the handshake follows); within ``redial_timeout`` if we
        lost contact with ``peer`` (see :meth:`~asyncrpc.agent.routes.Routes.lost`)."""
        lost = self._routes.lost_contact(peer)
        bound = self.options.redial_timeout
        connecting = dial(address, lambda: self._new_link(Role.DIALER), worker=peer)
        if lost is None or bound >= self.options.connect_timeout:
            return await connecting
        try:
            async with asyncio.timeout(bound):
                return await connecting
        except TimeoutError:
            raise PeerLostError(
                f"worker {peer!r} at {address} did not answer within {bound:g}s "
                f"(redial_timeout, since contact with it was lost: {lost})",
                worker=peer,
                sent=False,
            ) from None

    def _expire(self, call_id: int) -> None:
        call = self._pending.get(call_id)
        if call is None:
            return
        self._tell_cancelled(call_id, call)
        self._finish(
            call_id,
            error=RPCTimeoutError(
                f"call to {call.function} on worker {call.peer!r} timed out after {call.timeout}s",
                worker=call.peer,
                function=call.function,
            ),
        )

    def _call_cancelled(self, call_id: int) -> None:
        """The caller cancelled the call's future: cancel the call (see CallFuture)."""
        call = self._pending.get(call_id)
        if call is None:
            return
        self._tell_cancelled(call_id, call)
        self._finish(call_id, error=asyncio.CancelledError())

    def _tell_cancelled(self, call_id: int, call: PendingCall) -> None:
        """Tell the callee to cancel the call (a request still waiting for its link is
        never sent: it is no longer pending then)."""
        link = self._links.get(call.peer)
        if link is not None and not link.closed:
            link.send(Kind.CANCEL, {"i": call_id})

    def _finish(
        self, call_id: int, *, result: Any = None, error: BaseException | None = None
    ) -> None:
        call = self._pending.pop(call_id, None)
        if call is None:
            return
        outcome = "ok" if error is None else outcome_of(error)
        self.metrics.made(call.function, outcome, time.perf_counter() - call.started)
        if call.span is not None:
            spans.end(call.span)
        if not call.future.done():
            if error is None:
                call.future.set_result(result)
            else:
                call.future.set_exception(error)
        if not self._pending and self._idle is not None:
            self._idle.set_result(None)
            self._idle = None

    def _on_reply(self, link: Link, frame: Frame) -> None:
        call_id = frame.meta.get("i")
        if type(call_id) is not int:
            return
        call = self._pending.get(call_id)
        if call is None or call.peer != link.peer.name:
            return  # a late reply to a call that already timed out
        try:
            meta = frame.meta
            value = loads_reply(
                self,
                link.peer.rank,
                frame.payload,
                frame.buffers,
                plain=PLAIN in meta,
                tensors=meta.get(TENSORS),
            )
            if frame.kind == RESPONSE:
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
            allocate=self._storage.allocate,
            segments=self._segments,
            max_mapped_bytes=self.options.shared_memory_budget,
            handshake_timeout=self.options.handshake_timeout,
            silence_timeout=self.options.silent_peer_timeout,
            stripes=self._stripe_listener,
        )

    def _inbound_link(self) -> asyncio.BaseProtocol:
        return self._admission.admit(lambda: self._new_link(Role.LISTENER))

    def link_established(self, link: Link) -> None:
        if link.handshake.role is Role.LISTENER:
            self._admission.settled(link)
            self._inbound.add_link(link)
        self._carry_out(self._shutdown.connected(link.peer.name, link))

    def frame_received(self, link: Link, frame: Frame) -> None:
        if self._early_frames is not None:  # not joined yet: handled in join()
            self._early_frames.append((link, frame))
            return
        notices = frame.meta.get("n")
        if notices is not None:
            handle(self, link.peer.rank, notices)
        kind = frame.kind
        if kind == REQUEST:
            self._inbound.on_request(link, frame)
        elif kind in _REPLIES:
            self._on_reply(link, frame)
        elif kind == Kind.CANCEL:
            self._inbound.on_cancel(link, frame)
        elif kind == Kind.SHUTDOWN:
            self._on_shutdown_notice(link, frame.meta.get("phase"))
        self._poller.kick(behind=True)  # after what the frame scheduled

    def frames_sent(self, link: Link) -> None:
        self._poller.kick()  # a request or a reply left: an answer, or the next call, may follow

    def link_lost(self, link: Link, exc: BaseException) -> None:
        _add_bytes(self._bytes_of_lost_links, link)
        self._admission.settled(link)
        self._inbound.drop_link(link)
        peer = link.handshake.peer
        if peer is not None and link.handshake.established and self.state.usable:
            for extension in list(self._extensions.values()):
                extension.peer_lost(peer.rank)
        if peer is None:
            return
        self._shutdown.link_closed(link)
        if self._links.get(peer.name) is not link:  # an inbound link: dead if it was the last
            if link.handshake.established and self._no_link_with(peer.name):
                self._mark_dead(peer.name)
            return
        del self._links[peer.name]
        if not self.state.ending:
            self._routes.lost(peer.name, str(exc))
        self._mark_dead(peer.name)
        for call_id, call in list(self._pending.items()):
            if call.peer == peer.name:
                self._finish(call_id, error=self._lost_during(call, exc))

    @staticmethod
    def _lost_during(call: PendingCall, exc: BaseException) -> PeerLostError:
        """What a call in flight fails with when its link is lost (``exc``)."""
        lost = PeerLostError(
            f"lost connection to worker {call.peer!r} during call to {call.function}: {exc}",
            worker=call.peer,
            function=call.function,
        )
        lost.__cause__ = exc
        return lost

    def _no_link_with(self, name: str) -> bool:
        return name not in self._links and self._inbound.link_from(name) is None

    def _mark_dead(self, name: str) -> None:
        if self.state.usable:
            self._carry_out(self._shutdown.peer_lost(name))

    # -- introspection and helpers -------------------------------------------------

    def debug_info(self) -> dict[str, Any]:
        """Pending outgoing calls, running incoming calls, connected peers and more."""
        dialed = {name for name, link in self._links.items() if not link.closing}
        peers = self._inbound.peers | dialed
        info: dict[str, Any] = {
            "worker": self.info.name,
            "rank": self.info.id,
            "state": self.state.value,
            "pending_outgoing_calls": len(self._pending),
            "queued_notices": len(self._notices),
            "running_incoming_calls": self._inbound.running,
            "connected_peers": sorted(peers),
            "pending_handshakes": self._admission.pending,
            "refused_connections": self._admission.refused,
            "dead_peers": sorted(self._shutdown.dead),
            "shared_memory": self._shared_memory_info(),
            "received_storage": self._storage.stats,
            "links": self._links_info(),
            "thread_pool": self._inbound.pool_stats,
            "bytes": self._bytes_by_transport(),
            "calls": self.metrics.snapshot(),
            "cuda": self._cuda_info(),
        }
        for extension in self._extensions.values():
            info.update(extension.debug_info())
        return info

    def _bytes_by_transport(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received so far, per transport (``unix``, ``tcp``, and
        ``shared_memory`` for buffers that went through segments), links lost included."""
        totals = {kind: dict(counts) for kind, counts in self._bytes_of_lost_links.items()}
        for link in [*self._links.values(), *self._inbound.links]:
            _add_bytes(totals, link)
        lent = self._segments.stats["bytes_lent"] if self._segments is not None else 0
        if lent or "shared_memory" in totals:
            totals.setdefault("shared_memory", {"sent": 0, "received": 0})["sent"] = lent
        return totals

    def _links_info(self) -> dict[str, dict[str, Any]]:
        """For each link we dialed: its transport and shared memory, and why."""
        return {
            name: {**self._routes.why(name), **link.sharing, **link.striping}
            for name, link in sorted(self._links.items())
        }

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
        if self._loop.is_running() and on_loop_thread(self._loop):
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

    @property
    def lost_peers(self) -> set[str]:
        """Workers this one lost contact with (a link lost, a dial failed) and has not
        reached again since."""
        return set(self._shutdown.dead)

    def pending_functions(self) -> list[str]:
        """The function (or label) of each call this worker made that has not ended."""
        return [call.function for call in self._pending.values()]

    def find_extension(self, key: str) -> Extension | None:
        """The extension registered under ``key``, if any."""
        return self._extensions.get(key)

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
        memory need the CPU (a spinning loop starves them, and they it)."""
        copying = self._segments.copying if self._segments is not None else 0
        return (
            self.state is not Lifecycle.CLOSED
            and self._inbound.slow_threads_busy == 0
            and not copying
        )

    def _check_usable(self) -> None:
        if not self.state.usable:
            raise AgentStateError(f"RPC agent of {self.info.name!r} is {self.state.value}")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro, context=self._context.copy())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop


def _add_bytes(totals: dict[str, dict[str, int]], link: Link) -> None:
    """Add ``link``'s byte counts to ``totals`` (transport -> sent, received)."""
    for kind, sent, received in (
        (link.transport_kind, link.bytes_sent, link.bytes_received),
        ("shared_memory", 0, link.shared_bytes_received),  # (sent: the pool counts it)
        ("tcp_stripes", *link.striped_bytes),
    ):
        if sent or received:
            counts = totals.setdefault(kind, {"sent": 0, "received": 0})
            counts["sent"] += sent
            counts["received"] += received


def _quietly(task: asyncio.Task[Any]) -> None:
    """A background dial's outcome, whatever it is, is not an error of its own."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("connecting ahead of time failed: %r", task.exception())


def _busy(exc: BaseException) -> bool:
    """Whether a failed dial reached a live worker that did not answer in time."""
    cause = exc.__cause__
    return isinstance(cause, HandshakeError) and bool(cause.details.get("timed_out"))


def on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread is running ``loop`` now."""
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
