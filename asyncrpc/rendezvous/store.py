"""Rendezvous through torch's c10d Store: who is who, where to reach them, the job secret.

Theory of operation
-------------------
``init_method`` picks the store, exactly as torch.distributed does:

* ``tcp://host:port`` -- rank 0 hosts a ``TCPStore`` there, the others connect;
* ``env://`` -- MASTER_ADDR / MASTER_PORT (and RANK / WORLD_SIZE if not given);
  under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the elastic agent already
  hosts the store, so every rank connects as a client and none binds it;
* ``file://path`` -- a ``FileStore`` shared by the ranks.

Rank 0 hosts a TCPStore on the init_method's address only (torch's would listen
on every interface).  Its store is multi-tenant, as torch's rendezvous makes
them: where this process already serves that port (a process group's store on
MASTER_PORT), the server is shared.  Each job's keys live under a job number
that rank 0 takes from a counter in the store and the other ranks join
(:func:`open_job`), so one store serves several jobs in a row, and the keys a
failed attempt left (torchrun restarting its workers on its own store) are never
read as the next one's.

Each worker publishes one msgpack record under ``asyncrpc/job<n>/worker/<rank>`` and
reads everyone's; names are claimed with an atomic counter so a duplicate is
caught on both sides.  The job secret comes from ASYNCRPC_SECRET if set (then
it never touches the store), else rank 0 makes one and shares it here.

Every call here blocks (the store is C++); callers run them in a thread.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import random
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import msgpack
import torch.distributed as dist

from asyncrpc.errors import RPCTimeoutError

Store = Any
"""``torch.distributed.Store`` (its stubs do not show the class to type checkers)."""

PREFIX = "asyncrpc"
SECRET_ENV = "ASYNCRPC_SECRET"
EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_STORE_PORT = 10000


def create_store(init_method: str, rank: int, world_size: int, timeout: float) -> Store:
    """Open (or host, on rank 0) the store named by ``init_method``."""
    scheme = init_method.partition("://")[0]
    wait = timedelta(seconds=timeout)
    if scheme == "tcp":
        host, port = master_address(init_method)
        return _tcp_store(host, port, rank, world_size, wait, hosted_by_agent=False)
    if scheme == "env":
        host, port = master_address(init_method)
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return _tcp_store(host, port, rank, world_size, wait, hosted_by_agent=agent_hosts)
    if scheme == "file":
        return dist.FileStore(  # type: ignore[attr-defined]
            urlsplit(init_method).path, world_size
        )
    raise _unsupported(init_method)


def _unsupported(init_method: str) -> ValueError:
    return ValueError(f"unsupported init_method {init_method!r} (use tcp://, env:// or file://)")


JOBS = f"{PREFIX}/jobs"
"""The store's count of asyncrpc jobs opened on it so far (job numbers start at 1)."""
SUPERSEDED = msgpack.packb([])
"""What a job that never opened is opened with once a newer one begins: no rank's token,
so whoever waits for it moves on to the newer one."""


def open_job(store: Store, rank: int, world_size: int) -> Store:
    """The part of ``store`` where this job's keys live, agreed with the other ranks.

    A store outlives jobs: a process group's, torchrun's agent store across restarts of
    its workers, one passed to init_rpc twice.  Its earlier jobs' keys must not be read
    as this job's, whoever left them (dead processes of a failed attempt included).  So
    rank 0 opens a job with a new number (a counter in the store), each other rank says
    it joins that job with a random token, and rank 0 publishes the tokens of everyone
    who joined: a rank that finds the job open without its token has found an older
    job (its rank 0 gone) and waits for the next one.  A rank 0 that opens a job opens
    the one before it with no tokens (``SUPERSEDED``) if it never opened, so a rank
    waiting for that one moves on at once: every wait here is one store wait, bounded by
    the rendezvous timeout."""
    job = _open(store, world_size) if rank == 0 else _join(store, rank, world_size)
    return dist.PrefixStore(_scope(job), store)  # type: ignore[attr-defined]


def _scope(job: int) -> str:
    """Where job ``job``'s keys live in the store."""
    return f"{PREFIX}/job{job}"


def _open(store: Store, world_size: int) -> int:
    """Rank 0: a new job number; returns once every rank has joined it."""
    job = int(store.add(JOBS, 1))
    if job > 1:  # the job before, if it never opened (its rank 0 died), never will
        store.compare_set(f"{_scope(job - 1)}/open", b"", SUPERSEDED)
    scope = _scope(job)
    store.set(f"{scope}/created", b"")
    store.set(f"{scope}/joined/0", b"")
    _wait_for_ranks(store, f"{scope}/joined", world_size, "joined", 0)
    tokens = [bytes(store.get(f"{scope}/joined/{r}")) for r in range(world_size)]
    store.set(f"{scope}/open", msgpack.packb(tokens))
    return job


def _join(store: Store, rank: int, world_size: int) -> int:
    """Another rank: the number of the job its rank 0 opened with it (see open_job)."""
    token = secrets.token_bytes(16)
    deadline = time.monotonic() + store.timeout.total_seconds()
    stale = 0  # every job up to this one is not ours
    while True:
        scope = _scope(stale + 1)
        _wait_until(store, f"{scope}/created", deadline, scope, world_size)
        job = int(store.add(JOBS, 0))  # the newest (a job opened after ours began is not)
        store.set(f"{_scope(job)}/joined/{rank}", token)
        tokens = _tokens_when_open(store, job, deadline, world_size)
        if rank < len(tokens) and tokens[rank] == token:
            return job
        stale = job


def _tokens_when_open(store: Store, job: int, deadline: float, world_size: int) -> Any:
    """The tokens job ``job`` opened with: none of this rank's if a newer job began first
    (its rank 0 then opens this one with no token: ``SUPERSEDED``).  One wait, not a
    poll: each store wait that times out makes torch's client log two warnings."""
    scope = _scope(job)
    _wait_until(store, f"{scope}/open", deadline, scope, world_size)
    return msgpack.unpackb(bytes(store.get(f"{scope}/open")))


def _wait_until(store: Store, key: str, deadline: float, scope: str, world_size: int) -> None:
    """Wait for ``key`` until ``deadline``, then an RPCTimeoutError naming the ranks that
    have not joined ``scope``."""
    wait = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    try:
        store.wait([key], wait)
    except dist.DistNetworkError:
        raise
    except RuntimeError:  # a timeout (DistStoreError from a TCPStore)
        joined = f"{scope}/joined"
        raise _missing_ranks(store, joined, world_size, "joined", store.timeout) from None


def master_address(init_method: str) -> tuple[str, int]:
    """The store's host and port for ``tcp://`` and ``env://``."""
    if init_method.startswith("env://"):
        try:
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except KeyError as missing:
            raise ValueError(f"env:// rendezvous needs the variable {missing}") from None
    if not init_method.startswith("tcp://"):
        raise _unsupported(init_method)
    parts = urlsplit(init_method)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"init_method {init_method!r} needs a host and a port")
    return parts.hostname, parts.port


def _tcp_store(
    host: str, port: int, rank: int, world_size: int, wait: timedelta, *, hosted_by_agent: bool
) -> Store:
    if rank != 0 or hosted_by_agent:
        return _connected(host, port, world_size, wait)
    sock = _listening_socket(host, port)
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            port,
            world_size,
            True,
            wait,
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=None if sock is None else sock.fileno(),
        )
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if sock is not None:
        sock.detach()  # the store's server owns the descriptor now
    return store


STORE_ANSWER_GRACE = 10.0
"""Seconds a store client may take beyond its timeout to connect and be answered."""


def _connected(host: str, port: int, world_size: int, wait: timedelta) -> Store:
    """A client of the TCPStore at ``host:port``.  torch's constructor retries the
    connection for ``wait``, then waits for the server's answer without a bound: a
    listener that is no store, or a store process that hangs (one left over from an
    earlier job, stopped), would hold ``init_rpc`` forever.  So it runs in a daemon
    thread, given up (and left blocked, never joined at exit) after ``wait`` and
    ``STORE_ANSWER_GRACE``; RPCTimeoutError then."""
    connected: Future[Store] = Future()

    def connect() -> None:
        try:
            connected.set_result(
                dist.TCPStore(  # type: ignore[attr-defined]
                    host, port, world_size, False, wait, wait_for_workers=False
                )
            )
        except BaseException as exc:
            connected.set_exception(exc)

    threading.Thread(target=connect, name="asyncrpc-store-connect", daemon=True).start()
    limit = wait.total_seconds() + STORE_ANSWER_GRACE
    try:
        return connected.result(timeout=limit)
    except TimeoutError:
        if connected.done():  # the store's own error
            raise
        raise RPCTimeoutError(
            f"rendezvous did not complete: the store at {host}:{port} took the connection "
            f"but did not answer within {limit:g}s (is another program listening there, or "
            "a process of an earlier job that hangs?)"
        ) from None


def _listening_socket(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host``'s address only: torch's TCPStore would listen on
    every interface, and anyone who reaches the store can read the job secret in it.
    None if the port is taken: perhaps by this very process (a process group's store),
    whose server the store then shares, else the store says the port is in use."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise dist.DistNetworkError(
            f"rank 0 cannot host the rendezvous store on {host}:{port}: {exc}"
        ) from exc
    return sock


def free_port(host: str = "127.0.0.1", tries: int = 100) -> int:
    """A TCP port on ``host`` that is free now, to host a job's store (``MASTER_PORT``).

    Where the kernel says which ports it hands out by itself (Linux), the port is drawn
    from below that range, so that nothing the job's own processes do before rank 0
    binds it -- a listener on port 0, an outgoing connection -- can take it.  Elsewhere,
    or if ``tries`` draws are all taken, the kernel picks one.
    """
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    ephemeral_low = _ephemeral_low()
    draw = random.SystemRandom()  # not the seeded module generator: jobs started together differ
    for _ in range(tries if ephemeral_low > LOWEST_STORE_PORT else 0):
        port = draw.randrange(LOWEST_STORE_PORT, ephemeral_low)
        with socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (0 where it does not say)."""
    try:
        with open(EPHEMERAL_PORTS, encoding="ascii") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def listen_host_for(init_method: str, store: Store | None = None) -> str:
    """The local address peers of this job can reach: loopback for a loopback job,
    else the interface that routes to the store's host.  A FileStore (or a store
    of unknown host) means one machine unless ``listen_host`` says otherwise."""
    if store is not None:
        host, port = getattr(store, "host", None), getattr(store, "port", 0)
        if host is None:
            return "127.0.0.1"
    elif init_method.startswith("file://"):
        return "127.0.0.1"
    else:
        host, port = master_address(init_method)
    try:
        resolved = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][4][0]
    except OSError as exc:
        raise ValueError(
            f"cannot resolve the store host {host!r} ({exc}); pass listen_host= explicitly"
        ) from exc
    if ipaddress.ip_address(resolved).is_loopback:
        return str(resolved)
    family = socket.AF_INET6 if ":" in str(resolved) else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((resolved, port))  # no packet is sent: this only picks a route
        return str(probe.getsockname()[0])


def job_secret(store: Store, rank: int) -> bytes:
    """The per-job secret that peers prove to each other in the handshake."""
    from_env = os.environ.get(SECRET_ENV)
    if from_env:
        return from_env.encode()
    key = "secret"
    if rank == 0:
        store.set(key, secrets.token_bytes(32))
    return bytes(store.get(key))


def exchange(
    store: Store, rank: int, world_size: int, record: dict[str, Any], name: str
) -> list[dict[str, Any]]:
    """Publish our record, claim our name, and return every worker's record by rank.

    Every rank reads every record before rank 0 goes on, so a rank that finds a
    duplicate name still reaches the store rank 0 hosts, and each rank says what
    is wrong rather than only that the store went away."""
    claims = store.add(f"name/{name}", 1)
    what = ("joined", "the workers' addresses")
    records = gather(store, "worker", rank, world_size, record, what)
    if claims > 1:
        raise ValueError(f"worker name {name!r} is not unique: more than one rank uses it")
    seen: dict[str, int] = {}
    for r in records:
        if r["name"] in seen:
            raise ValueError(
                f"worker name {r['name']!r} is not unique: ranks {seen[r['name']]} and "
                f"{r['rank']} both use it"
            )
        seen[r["name"]] = r["rank"]
    return records


def gather(  # noqa: PLR0917 (the rendezvous runs it in a thread: positional)
    store: Store, prefix: str, rank: int, world_size: int, value: Any, what: tuple[str, str]
) -> list[Any]:
    """Publish ``value`` (msgpack-able) and return every rank's, by rank.  Rank 0 (which
    may host the store) goes on only once every rank has read them all.  ``what``: the
    step and the values, as a timeout names them ("joined", "the workers' addresses")."""
    store.set(f"{prefix}/{rank}", msgpack.packb(value))
    _wait_for_ranks(store, prefix, world_size, what[0], rank)
    values = [msgpack.unpackb(bytes(store.get(f"{prefix}/{r}"))) for r in range(world_size)]
    store.set(f"{prefix}/read/{rank}", b"")
    if rank == 0:
        _wait_for_ranks(store, f"{prefix}/read", world_size, f"read {what[1]}", rank)
    return values


_HOST_GRACE = timedelta(seconds=5)
"""Rank 0 waits this much longer than the others, so that they time out first and can
still read the store it hosts to say which ranks are missing."""


def _wait_for_ranks(store: Store, prefix: str, world_size: int, what: str, rank: int) -> None:
    """Wait until every rank has set ``prefix/<rank>``; a timeout names the missing ranks."""
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    wait = store.timeout + (_HOST_GRACE if rank == 0 else timedelta(0))
    try:
        store.wait(keys, wait)
    except dist.DistNetworkError:
        raise
    except RuntimeError:  # a timeout: DistStoreError from a TCPStore, plain from a FileStore
        raise _missing_ranks(store, prefix, world_size, what, wait) from None


def _missing_ranks(
    store: Store, prefix: str, world_size: int, what: str, waited: timedelta
) -> RPCTimeoutError:
    """The timeout that names the ranks which have not set ``prefix/<rank>``."""
    missing = [r for r in range(world_size) if not store.check([f"{prefix}/{r}"])]
    return RPCTimeoutError(
        f"rendezvous: rank(s) {missing} of {world_size} have not {what} "
        f"within {waited.total_seconds():g}s"
    )
