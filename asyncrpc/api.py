"""The public RPC API, named after torch.distributed.rpc; every network call is awaitable."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch.distributed as dist

from asyncrpc.agent import (
    AgentOptions,
    Lifecycle,
    RpcAgent,
    WorkerAddress,
    WorkerInfo,
    current_agent,
    set_default_agent,
    validate_name,
)
from asyncrpc.autograd.context import contexts_of
from asyncrpc.errors import AgentStateError, PeerLostError, RPCTimeoutError
from asyncrpc.rendezvous import (
    Store,
    create_store,
    exchange,
    gather,
    job_secret,
    listen_host_for,
    open_job,
)
from asyncrpc.rref import context_for
from asyncrpc.serde import cuda
from asyncrpc.serde.devices import (
    WorkerDevices,
    devices_used,
    normalize_devices,
    normalize_maps,
    validate,
)
from asyncrpc.transport import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_IDLE,
    DEFAULT_SILENT_PEER_TIMEOUT,
    DEFAULT_STRIPES,
)
from asyncrpc.wire import DEFAULT_MAX_FRAME_SIZE

log = logging.getLogger("asyncrpc")
# Jobs of at most this many workers connect every pair during init_rpc (as torch's agent
# does), waiting at most CONNECT_AHEAD_WAIT seconds; larger ones connect on first use.
CONNECT_AHEAD_UP_TO = 32
CONNECT_AHEAD_WAIT = 1.0
Target = str | int | WorkerInfo
T = TypeVar("T")


async def init_rpc(
    name: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str = "env://",
    store: Store | None = None,
    rpc_timeout: float = 60.0,
    num_worker_threads: int = 16,
    transports: tuple[str, ...] = ("unix", "tcp"),
    shared_memory: bool = True,
    shared_memory_budget: int = DEFAULT_BUDGET,
    shared_memory_idle: int = DEFAULT_MAX_IDLE,
    listen_host: str | None = None,
    listen_port: int | None = None,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    busy_poll: float | None = None,
    handshake_timeout: float = 10.0,
    silent_peer_timeout: float = DEFAULT_SILENT_PEER_TIMEOUT,
    tcp_stripes: int | None = None,
    metrics_port: int | None = None,
    dashboard: bool | None = None,
    device_maps: Mapping[str, Mapping[Any, Any]] | None = None,
    devices: Sequence[Any] | None = None,
) -> None:
    """Join the job as worker ``name`` and start serving calls.

    Rendezvous goes through a c10d Store: ``tcp://host:port`` (rank 0 hosts a
    TCPStore), ``env://`` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; under
    torchrun the agent's store is used), ``file://path``, or ``store=``.
    ``rpc_timeout`` is the default per-call timeout in seconds (0: none).
    ``transports`` lists what to listen on and prefer, in order ("unix" is used
    only between processes of one network namespace; where it fails, the next one,
    at once and for good: see ``get_debug_info()["links"]``).  ``listen_host`` is the
    address the tcp listener binds and peers dial (default: this host's address on
    the way to the rendezvous); ``listen_port`` (or the environment variable
    ``ASYNCRPC_LISTEN_PORT``) fixes its port, for a firewall rule or a Kubernetes
    NetworkPolicy: ``listen_port + LOCAL_RANK`` (torchrun sets ``LOCAL_RANK``, so the
    workers of one host differ; 0, the default: any free port; a port in use fails
    ``init_rpc``, naming it).  ``shared_memory`` enables the
    same-host path for large tensors; ``shared_memory_budget`` bounds the bytes of
    segments this worker holds (lent plus idle; beyond it, buffers go through the
    socket) and ``shared_memory_idle`` the idle ones kept for reuse.  ``busy_poll``
    (seconds, 0 to disable) keeps the event loop polling that long after activity
    instead of sleeping, which saves a wake-up per message on VMs at the cost of
    CPU while calls are in flight; by default 300 µs while this host's workers have
    a CPU each, else 0.
    ``handshake_timeout`` bounds a new connection's authentication: a peer whose
    event loop is blocked longer cannot be reached meanwhile (keep loops free of
    long blocking work rather than raising it).
    ``silent_peer_timeout`` (seconds, 0: the kernel's defaults) is how long a tcp
    peer may stay silent (no acknowledgement, no answer to keepalive probes: a
    partition, or its host died; a busy process still answers) before its link is
    dropped and the calls waiting on it fail with ``PeerLostError``; until a dial
    to it succeeds again, dials to it then wait at most 1 s (see docs/deploy.md).
    ``tcp_stripes`` (default ``ASYNCRPC_TCP_STRIPES``, else 2; 0 to disable) is how many
    side connections a tcp link without shared memory opens, to its peer's second,
    ephemeral port: buffers of 32 MiB or more cross them on threads of their own,
    several cores at once (where they cannot be made, the link carries everything;
    docs/deploy.md).
    ``metrics_port`` (or the environment variable ``ASYNCRPC_METRICS_PORT``) serves
    ``/metrics`` (Prometheus) and ``/debug`` (JSON) over HTTP on the listen host, at
    ``metrics_port + rank`` (0: a free port); ``dashboard`` (default: on rank 0 when
    metrics are served) adds the live job dashboard at ``/``.  See
    docs/observability.md.
    ``device_maps`` (``{"w1": {"cuda:0": "cuda:1"}}``; devices as ints, strings or
    ``torch.device``) says where this worker's CUDA tensors land on each peer, as
    torch's ``set_device_map`` does; replies travel by the inverse.  ``devices``
    lists the CUDA devices this worker uses (default: those the maps name).  Every
    worker's maps are checked against every other's devices here (``ValueError``).
    Between processes of one host, CUDA tensors travel by CUDA IPC (unless
    ``shared_memory=False``), else through pinned host memory; see docs/cuda.md.
    Returns once every worker has joined; what exists then is left out of the garbage
    collector's full collections until ``shutdown`` (``ASYNCRPC_GC_FREEZE=0``: not).
    """
    running = current_agent()
    if running is not None and running.state is not Lifecycle.CLOSED:
        raise AgentStateError("init_rpc was already called in this process; call shutdown first")
    validate_name(name)
    rank = _from_env("RANK") if rank is None else rank
    world_size = _from_env("WORLD_SIZE") if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    wait = rpc_timeout if rpc_timeout > 0 else 1800.0
    if listen_host is None:
        listen_host = listen_host_for(init_method, store)
    if store is None:
        store = await _rendezvous(create_store, init_method, rank, world_size, wait)
    store = await _rendezvous(open_job, store, rank, world_size)
    secret = await _rendezvous(job_secret, store, rank)
    options = AgentOptions(
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads,
        transports=transports,
        shared_memory=shared_memory,
        shared_memory_budget=shared_memory_budget,
        shared_memory_idle=shared_memory_idle,
        listen_host=listen_host,
        listen_port=_listen_port(listen_port),
        max_frame_size=max_frame_size,
        busy_poll=busy_poll,
        handshake_timeout=handshake_timeout,
        silent_peer_timeout=silent_peer_timeout,
        tcp_stripes=_tcp_stripes(tcp_stripes),
        devices=normalize_devices(devices),
        device_maps=normalize_maps(device_maps),
    )
    agent = RpcAgent(name, rank, secret, options)
    me = await agent.start()
    record = {**me.to_dict(), "cuda": agent.my_devices.to_dict()}
    try:
        records = await _rendezvous(exchange, store, rank, world_size, record, name)
        cuda_devices = await _cuda_devices(store, rank, records)
    except BaseException:
        await agent.shutdown(graceful=False)
        raise
    agent.join([WorkerAddress.from_dict(r) for r in records], cuda_devices)
    context_for(agent)  # RRefs and autograd contexts are part of every agent: count
    contexts_of(agent)  # them (get_debug_info) from the start
    agent.store = store
    set_default_agent(agent)
    if world_size <= CONNECT_AHEAD_UP_TO:
        await agent.connect_peers(within=CONNECT_AHEAD_WAIT)
    _freeze_garbage_collector()
    port = metrics_port
    if port is None:
        port = _int_from_env("ASYNCRPC_METRICS_PORT", "a port number")
    if port is not None:
        await _observe(agent, listen_host, port + rank if port else 0, dashboard, rank)


GC_FREEZE_ENV = "ASYNCRPC_GC_FREEZE"
_froze_gc = False


def _freeze_garbage_collector() -> None:
    """Leave what exists once the worker is up (torch, the user's modules and model, the
    agent) out of the garbage collector's full collections: with torch imported a full
    collection walks some 170k objects, 65-70 ms on the project's VM, with the loop
    stopped, whenever enough new objects have outlived younger collections (in the
    middle of a transfer, or of a training step).  ``ASYNCRPC_GC_FREEZE=0`` keeps the
    collector as it was.  Objects frozen here that become cyclic garbage later are
    collected only after ``shutdown`` (which unfreezes them); reference counting still
    frees the rest at once."""
    global _froze_gc
    if os.environ.get(GC_FREEZE_ENV, "1") != "0":
        gc.freeze()
        _froze_gc = True


def _unfreeze_garbage_collector() -> None:
    """Give what init_rpc froze back to the collector (a process may init_rpc again)."""
    global _froze_gc
    if _froze_gc:
        gc.unfreeze()
        _froze_gc = False


async def _cuda_devices(
    store: Store, rank: int, records: list[dict[str, Any]]
) -> dict[str, WorkerDevices]:
    """Every worker's CUDA devices and maps, checked (``ValueError``, the same on every
    worker).  In a job with device maps, the workers then publish their GPUs' UUIDs,
    so that senders know which peers can open their memory by CUDA IPC."""
    found = {r["name"]: WorkerDevices.from_dict(r["name"], r.get("cuda")) for r in records}
    validate(found)
    if not any(w.maps for w in found.values()):
        return found
    used = devices_used(records[rank]["name"], found)
    uuids = cuda.gpu_uuids() if used else {}
    cuda.prepare(used)
    mine = {f"cuda:{index}": uuid for index, uuid in uuids.items()}
    what = ("published their GPUs", "the workers' GPUs")
    gpus = await _rendezvous(gather, store, "gpus", rank, len(records), mine, what)
    named = zip(records, gpus, strict=True)
    return {r["name"]: replace(found[r["name"]], gpus=g) for r, g in named}


async def _observe(
    agent: RpcAgent, host: str, port: int, dashboard: bool | None, rank: int
) -> None:
    """Serve this worker's metrics (and the dashboard) over HTTP; a port that cannot be
    had is logged and reported in ``get_debug_info()``, and the job goes on."""
    from asyncrpc.observability import ObservabilityServer  # noqa: PLC0415 (aiohttp, if asked)

    server = ObservabilityServer(
        agent, host, port, dashboard=rank == 0 if dashboard is None else dashboard
    )
    agent.extension(ObservabilityServer.KEY, lambda _: server)
    try:
        url = await server.start()
    except OSError as exc:
        server.error = f"cannot serve metrics at {host}:{port}: {exc}"
        log.error("worker %r: %s", agent.info.name, server.error)
        return
    log.info("worker %r serves metrics at %s/metrics", agent.info.name, url)


async def _stop_observing(agent: RpcAgent) -> None:
    server = agent.find_extension(_OBSERVABILITY)
    if server is not None:
        await server.stop()  # type: ignore[attr-defined]  # an ObservabilityServer


_OBSERVABILITY = "observability"  # ObservabilityServer.KEY, without importing aiohttp


def _listen_port(given: int | None) -> int:
    """The tcp port to listen on: ``listen_port`` (else the environment's
    ``ASYNCRPC_LISTEN_PORT``) plus ``LOCAL_RANK`` (torchrun's; 0 without it), so the
    workers of one host differ; 0 (any free port) if neither is given."""
    if given is None:
        given = _int_from_env("ASYNCRPC_LISTEN_PORT", "a port number") or 0
    if not given:
        return 0
    port = given + (_int_from_env("LOCAL_RANK", "a local rank") or 0)
    if not 0 < port <= 65535:
        raise ValueError(f"listen_port {given} + LOCAL_RANK is {port}: not a port number")
    return port


def _tcp_stripes(given: int | None) -> int:
    """``tcp_stripes``, else the environment's ``ASYNCRPC_TCP_STRIPES``, else the default."""
    if given is None:
        given = _int_from_env("ASYNCRPC_TCP_STRIPES", "a number of side connections")
    return DEFAULT_STRIPES if given is None else given


def _int_from_env(variable: str, what: str) -> int | None:
    text = os.environ.get(variable, "")
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r} is not {what}") from None


def _from_env(variable: str) -> int:
    try:
        return int(os.environ[variable])
    except (KeyError, ValueError):
        raise ValueError(
            f"init_rpc needs {variable.lower()}= or the environment variable {variable} "
            "(torchrun sets it)"
        ) from None


async def _rendezvous(step: Callable[..., T], *args: Any) -> T:
    """Run a blocking store step in a thread; the store's timeouts become ours."""
    try:
        return await asyncio.to_thread(step, *args)
    except dist.DistNetworkError as exc:
        raise PeerLostError(
            f"rendezvous failed: the store cannot be reached (rank 0 hosts it; did it fail?): {exc}"
        ) from exc
    except dist.DistStoreError as exc:
        raise RPCTimeoutError(f"rendezvous did not complete: {exc}") from exc


def _agent() -> RpcAgent:
    agent = current_agent()
    if agent is None:
        raise AgentStateError("RPC is not initialised: call `await asyncrpc.init_rpc(...)` first")
    return agent


def rpc_async(
    to: Target,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> asyncio.Future[Any]:
    """Call ``func(*args, **kwargs)`` on worker ``to``; returns a future of the result.

    The request is sent at once.  ``to`` is a worker name, a rank or a
    WorkerInfo.  ``timeout`` (seconds) defaults to ``rpc_timeout`` (so does a negative
    one, as in torch); 0 means none.
    A remote exception is re-raised here as its own type (else ``RemoteError``)
    with the remote worker, function and traceback attached.
    """
    return _agent().rpc_async(to, func, args, kwargs, timeout)


def rpc_sync(
    to: Target,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> Any:
    """Blocking form of :func:`rpc_async`, for threads other than the event loop's
    (called on the loop thread it raises instead of deadlocking)."""
    agent = _agent()
    limit = agent.options.timeout_for(timeout)
    return agent.run_blocking(
        lambda: agent.rpc_async(to, func, args, kwargs, timeout), limit, f"rpc_sync to {to!r}"
    )


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """The WorkerInfo of ``worker_name`` (a name or a rank), or of this worker when None."""
    agent = _agent()
    return agent.info if worker_name is None else agent.resolve(worker_name).info


def get_debug_info() -> dict[str, Any]:
    """This worker's state: pending outgoing calls, running incoming calls, peers and more."""
    return _agent().debug_info()


async def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Leave the job.  Graceful: wait for our calls and for every live worker to call
    shutdown too (workers known to be dead are skipped), then release what workers
    share and close.  ``timeout=None`` waits for the others as long as they are
    alive, as torch does (a worker that only serves calls this at once), and bounds
    the release by ``rpc_timeout``; a number bounds all of it; 0 or less, nothing."""
    agent = _agent()
    try:
        await agent.shutdown(graceful=graceful, timeout=timeout)
    finally:
        set_default_agent(None)
        await _stop_observing(agent)
        _unfreeze_garbage_collector()
