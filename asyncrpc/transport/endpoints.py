"""Addresses and the schemes that serve them: ``tcp://host:port`` and ``unix://path``.

A unix path that starts with ``@`` names a Linux abstract socket (no file to
clean up).  ``listen`` returns the bound address in the same form, with a real
port in place of port 0.  A scheme is a :class:`Scheme` in ``SCHEMES``: how to
listen and dial, what a worker listens on (``listen_target``), and, for one that
reaches only some workers, what they must share with us (``scope``: unix sockets
reach only the workers of our network namespace; see :mod:`.locality`).  The agent
asks nothing else of a transport, so a new one is a new entry here.  A dial that
finds nobody at the address raises ``PeerLostError`` with ``unreachable=True`` (the
agent then tries the peer's next scheme, if the failed one had a scope).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from asyncrpc.errors import PeerLostError
from asyncrpc.transport.locality import NETWORK, Scope

P = TypeVar("P", bound=asyncio.BaseProtocol)
Factory = Callable[[], asyncio.BaseProtocol]


@dataclass(frozen=True, slots=True)
class Scheme:
    """One transport: ``listen(factory, rest)`` and ``dial(factory, rest)`` take an
    address without its ``scheme://``; ``listen_target(host, unique, port)`` is the
    address a worker listens on, given the job's listen host, a name unique on this
    host and the port asked for (0: any; a scheme without ports ignores it);
    a scheme with a ``scope`` is used only between workers whose hosts share it."""

    listen: Callable[[Factory, str], Awaitable[tuple[asyncio.AbstractServer, str]]]
    dial: Callable[[Factory, str], Awaitable[asyncio.BaseProtocol]]
    listen_target: Callable[[str, str, int], str]
    scope: Scope | None = None

    @property
    def host_local(self) -> bool:
        """Whether it reaches only some workers of this host (those of its scope)."""
        return self.scope is not None


def _split(address: str) -> tuple[str, str]:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(
            f"unsupported address {address!r} (expected tcp://host:port or unix://path)"
        )
    return scheme, rest


def _host_port(rest: str) -> tuple[str, int]:
    parts = urlsplit(f"//{rest}")
    return parts.hostname or "127.0.0.1", parts.port or 0


def _unix_path(rest: str) -> str:
    return "\0" + rest[1:] if rest.startswith("@") else rest


async def _listen_tcp(factory: Factory, rest: str) -> tuple[asyncio.AbstractServer, str]:
    host, port = _host_port(rest)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, host, port, reuse_address=True)
    bound = server.sockets[0].getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return server, f"tcp://{shown}:{bound[1]}"


async def _dial_tcp(factory: Factory, rest: str) -> asyncio.BaseProtocol:
    host, port = _host_port(rest)
    _, protocol = await asyncio.get_running_loop().create_connection(factory, host, port)
    return protocol


async def _listen_unix(factory: Factory, rest: str) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.get_running_loop().create_unix_server(factory, _unix_path(rest))
    return server, f"unix://{rest}"


async def _dial_unix(factory: Factory, rest: str) -> asyncio.BaseProtocol:
    # Connect the socket ourselves: uvloop cannot dial abstract names, and a unix
    # connect never blocks for long.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_unix_path(rest))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_unix_connection(factory, sock=sock)
    return protocol


SCHEMES: dict[str, Scheme] = {
    "tcp": Scheme(_listen_tcp, _dial_tcp, lambda host, _, port: f"tcp://{host}:{port}"),
    "unix": Scheme(
        _listen_unix, _dial_unix, lambda _, unique, __: f"unix://@{unique}", scope=NETWORK
    ),
}


def host_of(address: str) -> str:
    """The host of a ``tcp://host:port`` address (brackets of an IPv6 one removed)."""
    scheme, rest = _split(address)
    if scheme != "tcp":
        raise ValueError(f"{address!r} is not a tcp address")
    return _host_port(rest)[0]


async def listen(address: str, factory: Factory) -> tuple[asyncio.AbstractServer, str]:
    """Serve ``address``; returns the server and the address peers should dial."""
    scheme, rest = _split(address)
    return await SCHEMES[scheme].listen(factory, rest)


async def dial(address: str, factory: Callable[[], P], *, worker: str) -> P:
    """Connect to ``address``; connection failures name ``worker``."""
    scheme, rest = _split(address)
    try:
        protocol = await SCHEMES[scheme].dial(factory, rest)
    except OSError as exc:
        raise PeerLostError(
            f"cannot connect to worker {worker!r} at {address}: {exc}",
            worker=worker,
            unreachable=True,
        ) from exc
    return protocol  # type: ignore[return-value]
