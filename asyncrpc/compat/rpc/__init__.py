"""``torch.distributed.rpc``'s API on asyncrpc: ``import asyncrpc.compat.rpc as rpc``.

The blocking API with torch's names, signatures and semantics (see docs/compat.md).
Submodules mirror torch's: ``api``, ``functions``, ``constants``, ``options``,
``backend_registry``, ``internal``.  Private torch names that compat lacks resolve
to stand-ins that raise when used.
"""

from asyncrpc.compat._private import private_getattr
from asyncrpc.compat.errors import (
    ConfigurationError,
    PeerLostError,
    RemoteError,
    RPCTimeoutError,
    RRefError,
    SerializationError,
    UnknownWorkerError,
)
from asyncrpc.compat.rpc import api, backend_registry, constants, functions, internal, options
from asyncrpc.compat.rpc.api import (
    _get_current_rpc_agent,
    _get_debug_info,
    _rref_context_get_debug_info,
    _set_rpc_timeout,
    _wait_all,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from asyncrpc.compat.rpc.backend_registry import BackendType
from asyncrpc.compat.rpc.options import RpcBackendOptions, TensorPipeRpcBackendOptions
from asyncrpc.compat.rpc.rref import RRef, WorkerInfo

__getattr__ = private_getattr("torch.distributed.rpc")

__all__ = (
    "BackendType",
    "ConfigurationError",
    "PeerLostError",
    "RPCTimeoutError",
    "RRef",
    "RRefError",
    "RemoteError",
    "RpcBackendOptions",
    "SerializationError",
    "TensorPipeRpcBackendOptions",
    "UnknownWorkerError",
    "WorkerInfo",
    "_get_current_rpc_agent",
    "_get_debug_info",
    "_rref_context_get_debug_info",
    "_set_rpc_timeout",
    "_wait_all",
    "api",
    "backend_registry",
    "constants",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "internal",
    "is_available",
    "options",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
)


def is_available() -> bool:
    """Always True: asyncrpc is the backend."""
    return True
