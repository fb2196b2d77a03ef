"""torch.distributed.rpc.backend_registry: one backend type, asyncrpc's, named TENSORPIPE."""

from __future__ import annotations

import enum
from typing import Any

from asyncrpc.compat.rpc.constants import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC
from asyncrpc.compat.rpc.options import TensorPipeRpcBackendOptions

__all__ = ("BackendType", "backend_registered", "construct_rpc_backend_options")


class BackendType(enum.Enum):
    """torch's backend names; every one runs on asyncrpc."""

    TENSORPIPE = "TENSORPIPE"


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` is a known backend type."""
    return backend_name in BackendType.__members__


def construct_rpc_backend_options(
    backend: BackendType,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> TensorPipeRpcBackendOptions:
    """The options object for ``backend`` (torch's helper)."""
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)
