"""asyncrpc: asyncio-native RPC for PyTorch distributed training.

Public names follow ``torch.distributed.rpc``; every call that touches the
network is awaitable.  See README.md and docs/ for the guide.

The package root imports nothing until a name is used (PEP 562): ``asyncrpc.init_rpc``
and ``from asyncrpc import RRef`` load what they need on first use, while the layers
below (``asyncrpc.wire``, ``asyncrpc.transport``) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from asyncrpc import _compiled

_compiled.install()  # before any compiled module loads: ASYNCRPC_PURE_PYTHON, stale builds

if TYPE_CHECKING:
    from asyncrpc import autograd, functions, nn, optim, serving
    from asyncrpc.agent import WorkerInfo
    from asyncrpc.api import (
        get_debug_info,
        get_worker_info,
        init_rpc,
        rpc_async,
        rpc_sync,
        shutdown,
    )
    from asyncrpc.errors import (
        AgentStateError,
        AsyncRPCError,
        HandshakeError,
        OverloadedError,
        PeerLostError,
        ProtocolError,
        RemoteError,
        RPCTimeoutError,
        RRefError,
        SerializationError,
        UnknownWorkerError,
    )
    from asyncrpc.rref import RRef, remote

__version__ = "0.1.0"

_SUBMODULES = frozenset({"autograd", "functions", "nn", "optim", "serving"})
_DEFINED_IN = {  # every other public name: the module it comes from
    "WorkerInfo": "asyncrpc.agent",
    **dict.fromkeys(
        ("get_debug_info", "get_worker_info", "init_rpc", "rpc_async", "rpc_sync", "shutdown"),
        "asyncrpc.api",
    ),
    **dict.fromkeys(
        (
            "AgentStateError",
            "AsyncRPCError",
            "HandshakeError",
            "OverloadedError",
            "PeerLostError",
            "ProtocolError",
            "RPCTimeoutError",
            "RRefError",
            "RemoteError",
            "SerializationError",
            "UnknownWorkerError",
        ),
        "asyncrpc.errors",
    ),
    "RRef": "asyncrpc.rref",
    "remote": "asyncrpc.rref",
}

__all__ = (
    "AgentStateError",
    "AsyncRPCError",
    "HandshakeError",
    "OverloadedError",
    "PeerLostError",
    "ProtocolError",
    "RPCTimeoutError",
    "RRef",
    "RRefError",
    "RemoteError",
    "SerializationError",
    "UnknownWorkerError",
    "WorkerInfo",
    "autograd",
    "functions",
    "get_debug_info",
    "get_worker_info",
    "init_rpc",
    "nn",
    "optim",
    "remote",
    "rpc_async",
    "rpc_sync",
    "serving",
    "shutdown",
)


def __getattr__(name: str) -> object:
    """Import a public name on first use, then keep it as a plain attribute."""
    if name in _SUBMODULES:
        value: object = importlib.import_module(f"{__name__}.{name}")
    elif name in _DEFINED_IN:
        value = getattr(importlib.import_module(_DEFINED_IN[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
