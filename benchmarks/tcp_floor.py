"""The floor of a large echo over loopback TCP here, measured without RPC, next to asyncrpc's.

``bench_rpc.py --workloads tcp`` compares asyncrpc and torch forced onto TCP.  This
script says what the socket itself allows: two processes, one TCP connection on
127.0.0.1, a payload of ``--mb`` MB sent and echoed back, the receiving side landing
every message in a fresh ``torch.empty`` (as both frameworks do):

* ``blocking sockets``: ``sendall``/``recv_into`` on both sides (no event loop);
* ``blocking reused``: the same into one buffer per side allocated once (no page
  faults of fresh memory: what fresh storage costs is the difference);
* ``2 streams reused``, ``4 streams reused``: the same, each payload striped over 2 or
  4 connections, one thread per connection on each side (what striping, as TensorPipe
  can do it, would buy on this path);
* ``uvloop protocols``: both sides run uvloop with the buffer sizes asyncrpc uses (a
  ``BufferedProtocol`` whose ``get_buffer`` hands out the rest of the destination, one
  ``write`` of the whole payload, ``set_write_buffer_limits(high=4 MiB)``, TCP_NODELAY);
* ``asyncrpc tcp``: ``rpc_async(echo)`` between two asyncrpc workers with
  ``transports=("tcp",), shared_memory=False`` (striped over its default side
  connections); ``asyncrpc one stream``: the same with ``tcp_stripes=0``.

Each round runs every kind once, alternating, in a fresh pair of processes: one
warm-up echo, then ``--echoes`` timed ones, of which the round keeps the median.
Printed: GB/s of bytes moved (twice the payload per echo) for every round, and the
median of the rounds.  Usage: ``python benchmarks/tcp_floor.py [--mb 4,64,400]
[--rounds 5] [--echoes 5] [--kinds ...] [--socket-buffer BYTES] [--veth]``;
``--socket-buffer`` sets SO_SNDBUF and SO_RCVBUF of the raw kinds' sockets (default: the
kernel's autotuning, as asyncrpc leaves it).  ``--veth`` runs the two processes in two
network namespaces joined by a veth pair (``_veth.py``; needs root), the floor of
``bench_rpc.py --workloads veth``: the echoing side listens on its end's address, the
rendezvous of the asyncrpc kind is at the timing side's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import uvloop
from _veth import Namespace, veth_pair, wrap

MB = 1 << 20
HIGH_WATER = 4 << 20
"""asyncrpc's write-buffer high-water mark (``Link.connection_made``)."""
BUFFER_ENV = "TCP_FLOOR_SOCKET_BUFFER"
"""How ``--socket-buffer`` reaches the processes of a round."""
HOSTS_ENV = "TCP_FLOOR_HOSTS"
"""The timing side's and the echoing side's addresses (``--veth``; else loopback)."""
Veth = tuple[Namespace, Namespace] | None
"""The timing side's namespace and the echoing side's (``--veth``), or None: loopback."""


def hosts() -> tuple[str, str]:
    """(the timing side's address: the rendezvous; the echoing side's: it listens there)."""
    driver, server = os.environ.get(HOSTS_ENV, "127.0.0.1,127.0.0.1").split(",")
    return driver, server


def fresh(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """New tensor storage and a writable byte view of it (asyncrpc's wire allocator)."""
    storage = torch.empty(nbytes, dtype=torch.uint8)
    return storage, storage.numpy().data


def tune(sock: socket.socket) -> socket.socket:
    """TCP_NODELAY, as asyncrpc sets it; and ``--socket-buffer`` bytes of SO_SNDBUF and
    SO_RCVBUF if given (else the kernel sizes them itself)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if size := int(os.environ.get(BUFFER_ENV, "0")):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    return sock


def connect(port: int) -> socket.socket:
    return tune(socket.create_connection((hosts()[1], port)))


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


# -- blocking sockets ---------------------------------------------------------------


def blocking_server(sock: socket.socket, nbytes: int, reuse: bool) -> None:
    conn = tune(sock.accept()[0])
    kept = fresh(nbytes)
    while True:
        _, view = kept if reuse else fresh(nbytes)
        if not recv_exactly(conn, view):
            return
        conn.sendall(view)


def blocking_client(port: int, nbytes: int, echoes: int, reuse: bool) -> list[float]:
    sock = connect_when_listening(port)
    _, data = fresh(nbytes)
    kept = fresh(nbytes)
    times = []
    for _ in range(echoes + 1):
        start = time.perf_counter()
        sock.sendall(data)
        _, view = kept if reuse else fresh(nbytes)
        recv_exactly(sock, view)
        times.append(time.perf_counter() - start)
    sock.close()
    return times[1:]


def streams_of(kind: str) -> int:
    """How many connections a striped kind ("2 streams reused") splits each payload over."""
    return int(kind.split(maxsplit=1)[0])


def striped_server(sock: socket.socket, nbytes: int, streams: int) -> None:
    """Each of ``streams`` connections echoes its share of every payload, in a thread of
    its own, into a buffer reused per connection."""
    conns = [tune(sock.accept()[0]) for _ in range(streams)]
    threads = [
        threading.Thread(target=_echo_share, args=(conn, share))
        for conn, share in zip(conns, shares(nbytes, streams), strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _echo_share(conn: socket.socket, nbytes: int) -> None:
    _, view = fresh(nbytes)
    while recv_exactly(conn, view):
        conn.sendall(view)


def shares(nbytes: int, streams: int) -> list[int]:
    return [nbytes // streams + (i < nbytes % streams) for i in range(streams)]


def striped_client(port: int, nbytes: int, echoes: int, streams: int) -> list[float]:
    """Each echo sends a payload cut in ``streams`` shares, one per connection and
    thread, and ends when every share is back."""
    socks = [connect_when_listening(port) for _ in range(streams)]
    parts = [(fresh(n)[1], fresh(n)[1]) for n in shares(nbytes, streams)]

    def one(i: int) -> None:
        data, view = parts[i]
        socks[i].sendall(data)
        recv_exactly(socks[i], view)

    times = []
    for _ in range(echoes + 1):
        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        times.append(time.perf_counter() - start)
    for sock in socks:
        sock.close()
    return times[1:]


# -- uvloop protocols ---------------------------------------------------------------


class Receiver(asyncio.BufferedProtocol):
    """Lands each message of ``nbytes`` in fresh storage; ``arrived`` gets each one."""

    def __init__(self, nbytes: int, arrived: Callable[[memoryview], None]) -> None:
        self.nbytes = nbytes
        self.arrived = arrived
        self.view = fresh(nbytes)[1]
        self.filled = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(high=HIGH_WATER)
        tune(transport.get_extra_info("socket"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled == self.nbytes:
            view, self.view, self.filled = self.view, fresh(self.nbytes)[1], 0
            self.arrived(view)

    def connection_lost(self, exc: Exception | None) -> None:
        asyncio.get_running_loop().stop()


class Echo(Receiver):
    """Writes each message back, from the storage it landed in."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes, self.echo)

    def echo(self, view: memoryview) -> None:
        self.transport.write(view)


def loop_server(sock: socket.socket, nbytes: int) -> None:
    async def serve() -> None:
        conn, _ = sock.accept()
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: Echo(nbytes), conn)
        await asyncio.Event().wait()

    with contextlib.suppress(RuntimeError):  # stopped when the client went away
        uvloop.run(serve())


async def loop_client(port: int, nbytes: int, echoes: int) -> list[float]:
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[memoryview]] = []
    _, receiver = await loop.create_connection(
        lambda: Receiver(nbytes, lambda v: waiting.pop(0).set_result(v)),
        sock=connect_when_listening(port),
    )
    _, data = fresh(nbytes)
    times = []
    for _ in range(echoes + 1):
        start = time.perf_counter()
        waiting.append(loop.create_future())
        receiver.transport.write(data)
        await waiting[-1]
        times.append(time.perf_counter() - start)
    receiver.transport.close()
    return times[1:]


# -- asyncrpc -----------------------------------------------------------------------


def echo(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


async def rpc_worker(name: str, rank: int, port: int, stripes: int) -> None:
    import asyncrpc
    from asyncrpc.transport import DEFAULT_STRIPES

    await asyncrpc.init_rpc(
        name,
        rank=rank,
        world_size=2,
        init_method=f"tcp://{hosts()[0]}:{port}",
        transports=("tcp",),
        shared_memory=False,
        tcp_stripes=DEFAULT_STRIPES if stripes < 0 else stripes,
    )


async def rpc_server(port: int, stripes: int) -> None:
    import asyncrpc

    await rpc_worker("server", 1, port, stripes)
    await asyncrpc.shutdown(timeout=600)


async def rpc_client(port: int, nbytes: int, echoes: int, stripes: int) -> list[float]:
    import asyncrpc

    await rpc_worker("client", 0, port, stripes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(echoes + 1):
        start = time.perf_counter()
        result = await asyncrpc.rpc_async("server", echo, args=(data,))
        times.append(time.perf_counter() - start)
        if not torch.equal(result, data):
            raise AssertionError("the echo came back different")
        del result
    moved = asyncrpc.get_debug_info()["bytes"]
    received = sum(moved.get(kind, {}).get("received", 0) for kind in ("tcp", "tcp_stripes"))
    if not set(moved) <= {"tcp", "tcp_stripes"} or received < nbytes * (echoes + 1):
        raise AssertionError(f"not all through tcp: {moved}")
    await asyncrpc.shutdown()
    return times[1:]


# -- rounds -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listen(port: int) -> socket.socket:
    return socket.create_server((hosts()[1], port))


def connect_when_listening(port: int) -> socket.socket:
    for _ in range(500):
        try:
            return connect(port)
        except ConnectionRefusedError:
            time.sleep(0.01)
    raise TimeoutError(f"nobody listens on port {port}")


def serve(kind: str, port: int, nbytes: int) -> None:
    """The echoing side of one round (a process of its own)."""
    if kind in RPC:
        uvloop.run(rpc_server(port, RPC[kind]))
    elif kind == "uvloop protocols":
        loop_server(listen(port), nbytes)
    elif kind in STRIPED:
        striped_server(listen(port), nbytes, streams_of(kind))
    else:
        blocking_server(listen(port), nbytes, reuse=kind == "blocking reused")


def drive(kind: str, port: int, nbytes: int, echoes: int) -> list[float]:
    """The timing side of one round (a process of its own): seconds per echo."""
    if kind in RPC:
        return uvloop.run(rpc_client(port, nbytes, echoes, RPC[kind]))
    if kind == "uvloop protocols":
        return uvloop.run(loop_client(port, nbytes, echoes))
    if kind in STRIPED:
        return striped_client(port, nbytes, echoes, streams_of(kind))
    return blocking_client(port, nbytes, echoes, reuse=kind == "blocking reused")


def one_round(kind: str, nbytes: int, echoes: int, veth: Veth = None) -> list[float]:
    """Seconds per echo of ``kind``, in a fresh pair of processes (no fork: torch and
    asyncrpc start threads); with ``veth``, the timing side in its first namespace and
    the echoing side in its second."""
    port = free_port()  # (in fresh namespaces, every port is free)
    me = [sys.executable, __file__, "--role"]
    serve = [*me, "serve", kind, str(port), str(nbytes)]
    drive = [*me, "drive", kind, str(port), str(nbytes), str(echoes)]
    if veth:
        serve, drive = wrap(veth[1], serve), wrap(veth[0], drive)
    server = subprocess.Popen(serve)
    try:
        done = subprocess.run(drive, check=False, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{kind}, {nbytes} bytes: the timing side failed:\n{done.stderr}")
        out = done.stdout
    finally:
        server.wait(timeout=60)
    return [float(t) for t in out.split()]


STRIPED = ("2 streams reused", "4 streams reused")
"""Blocking reused buffers, each payload striped over several connections and threads
(as TensorPipe can): what striping would buy on this path."""
RPC = {"asyncrpc tcp": -1, "asyncrpc one stream": 0}
"""asyncrpc's kinds, and their ``tcp_stripes`` (-1: the default)."""
KINDS = ("blocking sockets", "blocking reused", *STRIPED, "uvloop protocols", *RPC)


def play(role: str, kind: str, port: str, nbytes: str, echoes: str = "0") -> None:
    """One side of a round, in a process of its own (the driver prints its times)."""
    if role == "serve":
        serve(kind, int(port), int(nbytes))
    else:
        print(" ".join(str(t) for t in drive(kind, int(port), int(nbytes), int(echoes))))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", default="4,64,400", help="payload sizes in MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--echoes", type=int, default=5, help="timed echoes per round")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    parser.add_argument(
        "--socket-buffer", type=int, default=0, help="SO_SNDBUF/SO_RCVBUF bytes (raw kinds)"
    )
    parser.add_argument(
        "--veth", action="store_true", help="across a veth pair between two namespaces (root)"
    )
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ[BUFFER_ENV] = str(args.socket_buffer)
    if args.role:
        play(*args.role)
        return
    if not args.veth:
        measure(args)
        return
    with veth_pair() as spaces:
        os.environ[HOSTS_ENV] = ",".join(ns.address for ns in spaces)
        measure(args, spaces)


def measure(args: argparse.Namespace, veth: Veth = None) -> None:
    """Every round, every size, every kind; then the table."""
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    sizes = [int(mb) * MB for mb in args.mb.split(",")]
    gbps: dict[tuple[int, str], list[float]] = {(n, k): [] for n in sizes for k in kinds}
    for _ in range(args.rounds):  # alternating, so that a noisy moment hits every kind
        for nbytes in sizes:
            for kind in kinds:
                seconds = statistics.median(one_round(kind, nbytes, args.echoes, veth))
                gbps[nbytes, kind].append(2 * nbytes / seconds / 1e9)
    print(
        f"echo over {'TCP across a veth pair' if veth else 'loopback TCP'}, two processes, "
        f"{args.rounds} rounds of {args.echoes} "
        f"echoes (GB/s moved, 2x the payload; per round, then the median), "
        f"load {os.getloadavg()[0]:.2f}"
    )
    for nbytes in sizes:
        floor = statistics.median(gbps[nbytes, kinds[0]])
        for kind in kinds:
            each = " ".join(f"{g:.2f}" for g in gbps[nbytes, kind])
            mid = statistics.median(gbps[nbytes, kind])
            print(
                f"  {nbytes // MB:4d} MB {kind:18s} median {mid:5.2f} "
                f"({mid / floor:4.0%} of {kinds[0]})   [{each}]"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
