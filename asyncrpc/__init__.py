"""asyncrpc: asyncio-native RPC for PyTorch distributed training.

Public names follow ``torch.distributed.rpc``; every call that touches the
network is awaitable.  See README.md and docs/ for the guide.
"""

from asyncrpc import autograd, functions, nn, optim
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

__all__ = (
    "AgentStateError",
    "AsyncRPCError",
    "HandshakeError",
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
    "shutdown",
)
