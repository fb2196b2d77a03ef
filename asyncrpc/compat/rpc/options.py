"""torch.distributed.rpc.options: backend options, with torch's names and defaults.

asyncrpc has one backend; ``TensorPipeRpcBackendOptions`` is accepted so that torch
programs run unchanged.  ``init_method``, ``rpc_timeout`` and ``num_worker_threads``
and TensorPipe's ``device_maps`` and ``devices`` are used, with torch's meaning
(docs/cuda.md); ``_transports`` / ``_channels`` are accepted and ignored.
"""

from __future__ import annotations

import numbers
from typing import Any

from asyncrpc.compat.rpc.constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
)

__all__ = ("RpcBackendOptions", "TensorPipeRpcBackendOptions")


class RpcBackendOptions:
    """What every backend takes: the rendezvous and the default call timeout."""

    def __init__(
        self,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
    ) -> None:
        self.rpc_timeout = _seconds(type(self).__name__, rpc_timeout)
        self.init_method = init_method


def _seconds(options: str, rpc_timeout: object) -> float:
    """``rpc_timeout`` as float seconds; anything but a real number (a ``timedelta``,
    say) is refused as torch's C++ constructor refuses it."""
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, numbers.Real):
        raise TypeError(
            f"{options}.__init__(): incompatible constructor arguments: rpc_timeout must be "
            f"a float (seconds), not {type(rpc_timeout).__name__}"
        )
    return float(rpc_timeout)


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's TensorPipe options; ``num_worker_threads`` sizes the callee's pool."""

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: dict[Any, dict[Any, Any]] | None = None,
        devices: list[Any] | None = None,
        _transports: list[str] | None = None,
        _channels: list[str] | None = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method)
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[Any, dict[Any, Any]] = dict(device_maps or {})
        self.devices: list[Any] = list(devices or [])
        self._transports = _transports
        self._channels = _channels

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Where this worker's CUDA tensors land on worker ``to`` (merged into its map;
        checked at ``init_rpc``, as in torch)."""
        self.device_maps.setdefault(to, {}).update(device_map)

    def set_devices(self, devices: list[Any]) -> None:
        """The CUDA devices this worker uses (default: those the device maps name)."""
        self.devices = list(devices)
