"""Unit tests for addresses and schemes: parsing, listening and dialing over real
sockets on both loops the agent runs on (asyncio and uvloop), and dial failures that
name the worker.

Each test runs its coroutine on a fresh loop of the parametrized kind; every wait is
bounded by ``BOUND_S``.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from asyncrpc.errors import PeerLostError
from asyncrpc.transport import endpoints
from asyncrpc.transport.endpoints import SCHEMES, dial, listen

BOUND_S = 5.0
Runner = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Runs a coroutine to completion on a fresh loop of the kind the test is for."""
    return asyncio.run if request.param == "asyncio" else uvloop.run


class Peer(asyncio.Protocol):
    """Records the connection and the bytes it receives."""

    def __init__(self) -> None:
        self.made: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()
        self.received = bytearray()
        self._arrived = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.set_result(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self.received += data
        self._arrived.set()

    async def read(self, size: int) -> bytes:
        while len(self.received) < size:
            self._arrived.clear()
            await self._arrived.wait()
        return bytes(self.received)


async def exchange(address: str) -> tuple[str, bytes]:
    """Listens on ``address``, dials the address ``listen`` returned, and sends bytes
    both ways; returns that address and what both ends received."""
    accepted: asyncio.Queue[Peer] = asyncio.Queue()

    def accept() -> Peer:
        peer = Peer()
        accepted.put_nowait(peer)
        return peer

    server, bound = await listen(address, accept)
    try:
        async with asyncio.timeout(BOUND_S):
            dialer = await dial(bound, Peer, worker="w1")
            (await dialer.made).write(b"ping")
            served = await accepted.get()
            (await served.made).write(b"pong")
            received = await served.read(4) + await dialer.read(4)
            (await dialer.made).close()
        return bound, received
    finally:
        server.close()


# -- parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address", ["127.0.0.1:80", "http://x:1", "tcp:/x:1", "udp://x:1", "", "://x"]
)
def test_an_unknown_or_malformed_address_is_refused_with_the_address_named(address: str) -> None:
    with pytest.raises(ValueError, match="unsupported address") as raised:
        asyncio.run(listen(address, asyncio.Protocol))
    assert repr(address) in str(raised.value)
    assert "tcp://host:port or unix://path" in str(raised.value)


def test_only_the_first_separator_ends_the_scheme() -> None:
    assert endpoints._split("unix:///tmp/a://b") == ("unix", "/tmp/a://b")


def test_dial_refuses_an_unknown_scheme_before_connecting() -> None:
    with pytest.raises(ValueError, match="unsupported address 'ipc://x'"):
        asyncio.run(dial("ipc://x", asyncio.Protocol, worker="w1"))


@pytest.mark.parametrize(
    ("rest", "host", "port"),
    [
        ("10.0.0.2:29500", "10.0.0.2", 29500),
        ("node-3:7", "node-3", 7),
        ("[::1]:8080", "::1", 8080),
        ("node-3", "node-3", 0),  # no port: any free one
        (":5", "127.0.0.1", 5),  # no host: this machine
        ("", "127.0.0.1", 0),
    ],
)
def test_host_and_port_of_a_tcp_address(rest: str, host: str, port: int) -> None:
    assert endpoints._host_port(rest) == (host, port)


def test_a_unix_path_starting_with_at_names_an_abstract_socket() -> None:
    assert endpoints._unix_path("@asyncrpc-w0") == "\0asyncrpc-w0"
    assert endpoints._unix_path("/tmp/w0.sock") == "/tmp/w0.sock"
    assert endpoints._unix_path("rel@tive") == "rel@tive"


def test_what_a_worker_listens_on_and_which_schemes_stay_on_one_host() -> None:
    tcp, unix = SCHEMES["tcp"], SCHEMES["unix"]
    assert tcp.listen_target("10.0.0.2", "job-w0", 0) == "tcp://10.0.0.2:0"
    assert tcp.listen_target("10.0.0.2", "job-w0", 29600) == "tcp://10.0.0.2:29600"
    assert unix.listen_target("10.0.0.2", "job-w0", 29600) == "unix://@job-w0"
    assert (tcp.host_local, unix.host_local) == (False, True)


# -- listening and dialing ------------------------------------------------------------------


def test_tcp_listen_returns_the_bound_port_and_carries_bytes_both_ways(run: Runner) -> None:
    bound, received = run(exchange("tcp://127.0.0.1:0"))
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert received == b"pingpong"


def test_tcp_serves_the_host_and_port_asked_for_and_dials_that_host(run: Runner) -> None:
    """127.0.0.2 is this machine too, but nothing else listens on it: a dial that lost
    the host (or a listener that took any port) would not meet."""
    port = closed_tcp_port("127.0.0.2")
    bound, received = run(exchange(f"tcp://127.0.0.2:{port}"))
    assert bound == f"tcp://127.0.0.2:{port}"
    assert received == b"pingpong"


def test_tcp_listen_on_an_ipv6_address_shows_it_in_brackets(run: Runner) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        bound, received = run(exchange("tcp://[::1]:0"))
    except OSError as exc:  # IPv6 compiled in but not configured
        pytest.skip(f"cannot bind ::1: {exc}")
    assert bound.startswith("tcp://[::1]:") and int(bound.rpartition(":")[2]) > 0
    assert received == b"pingpong"


def test_tcp_listen_sets_reuse_address(run: Runner) -> None:
    """A restarted worker binds its old port while connections of the last run wait out
    TIME_WAIT."""

    async def reuse_flag() -> int:
        server, _ = await listen("tcp://127.0.0.1:0", asyncio.Protocol)
        try:
            return int(server.sockets[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR))
        finally:
            server.close()

    assert run(reuse_flag()) != 0


def test_an_abstract_unix_address_is_served_and_dialed_without_a_file(
    run: Runner, tmp_path: Path
) -> None:
    name = f"asyncrpc-test-{os.getpid()}-{tmp_path.name}"
    bound, received = run(exchange(f"unix://@{name}"))
    assert bound == f"unix://@{name}"
    assert received == b"pingpong"
    assert not Path(name).exists() and not Path(f"@{name}").exists()


def test_a_unix_path_address_is_served_and_dialed(run: Runner, tmp_path: Path) -> None:
    path = tmp_path / "w0.sock"
    bound, received = run(exchange(f"unix://{path}"))
    assert bound == f"unix://{path}"
    assert received == b"pingpong"


# -- dial failures ----------------------------------------------------------------------------


def closed_tcp_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out on ``host`` and nobody listens on."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("scheme", ["tcp", "unix-abstract", "unix-path"])
def test_a_failed_dial_names_the_worker_and_the_address(
    run: Runner, scheme: str, tmp_path: Path
) -> None:
    address = {
        "tcp": f"tcp://127.0.0.1:{closed_tcp_port()}",
        "unix-abstract": f"unix://@asyncrpc-nobody-{os.getpid()}",
        "unix-path": f"unix://{tmp_path / 'nobody.sock'}",
    }[scheme]

    async def dial_nobody() -> None:
        async with asyncio.timeout(BOUND_S):
            await dial(address, asyncio.Protocol, worker="trainer3")

    with pytest.raises(PeerLostError) as raised:
        run(dial_nobody())
    message = str(raised.value)
    assert message.startswith(f"cannot connect to worker 'trainer3' at {address}: ")
    assert raised.value.worker == "trainer3"
    assert isinstance(raised.value.__cause__, OSError)
    assert str(raised.value.__cause__) in message


class Interrupt(BaseException):
    """Not an OSError, not even an Exception: a cancellation-like interruption."""


def test_a_unix_dial_interrupted_before_it_connects_closes_its_socket(
    run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[socket.socket] = []

    class Interrupted(socket.socket):
        def connect(self, address: Any) -> None:
            raise Interrupt

    def make(*args: Any) -> socket.socket:
        made.append(Interrupted(*args))
        return made[-1]

    async def dial_once() -> None:
        with monkeypatch.context() as patch:  # after the loop made its own sockets
            patch.setattr(socket, "socket", make)
            await dial("unix://@anything", asyncio.Protocol, worker="w")

    with pytest.raises(Interrupt):
        run(dial_once())
    assert len(made) == 1 and made[0].fileno() == -1  # closed
