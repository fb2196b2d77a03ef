"""``torch.distributed.nn.RemoteModule`` on asyncrpc (blocking ``forward``)."""

from __future__ import annotations

from typing import Any, cast

import torch

import asyncrpc.nn as native
from asyncrpc.compat import _runtime
from asyncrpc.compat.rpc.rref import RRef

__all__ = ("RemoteModule",)


class RemoteModule:
    """A module built on another worker (``remote_device``: ``"worker/device"``),
    called like a local one: ``forward`` and ``__call__`` block, ``forward_async``
    returns a ``torch.futures.Future``."""

    def __init__(
        self,
        remote_device: str,
        module_cls: type[torch.nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._native: native.RemoteModule = _runtime.call(
            lambda: native.RemoteModule(remote_device, module_cls, tuple(args or ()), kwargs),
            "RemoteModule()",
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on its worker and return the output (blocks)."""
        return _runtime.run(lambda: self._native.forward_async(*args, **kwargs), "forward")

    __call__ = forward

    def forward_async(self, *args: Any, **kwargs: Any) -> _runtime.Future[Any]:
        """Run the module's forward on its worker; a future of the output."""
        return _runtime.start_torch_future(
            lambda: self._native.forward_async(*args, **kwargs), "forward_async"
        )

    def remote_parameters(self, recurse: bool = True) -> list[RRef[torch.Tensor]]:
        """RRefs of the module's parameters (for ``DistributedOptimizer``)."""
        params = _runtime.run(lambda: self._native.remote_parameters(recurse), "remote_parameters")
        return cast(list[RRef[torch.Tensor]], params)  # compat makes every handle an RRef

    def get_module_rref(self) -> RRef[torch.nn.Module]:
        """The RRef of the module itself."""
        return cast(RRef[torch.nn.Module], self._native.get_module_rref())

    def train(self, mode: bool = True) -> RemoteModule:
        """Set training mode on the remote module (blocks); returns self."""
        _runtime.run(lambda: self._native.train(mode), "train")
        return self

    def eval(self) -> RemoteModule:
        """``train(False)``."""
        return self.train(False)
