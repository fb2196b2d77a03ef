"""RemoteModule: an ``nn.Module`` that lives on another worker, called like a local one.

``RemoteModule("ps/cpu", nn.EmbeddingBag, args=(1000, 16))`` builds the module on
worker ``ps`` (with ``remote()``: construction does not block) and forwards calls
to it.  Inside a distributed autograd context its forward passes are recorded
like any RPC, so a backward pass reaches its parameters, and
``remote_parameters()`` gives RRefs for a ``DistributedOptimizer``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncrpc.rref import RRef, remote

__all__ = ("RemoteModule",)


def _build(
    module_cls: type[torch.nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> torch.nn.Module:
    return module_cls(*args, **kwargs).to(device)


async def _parameter_rrefs(
    module: RRef[torch.nn.Module], recurse: bool
) -> list[RRef[torch.Tensor]]:
    built = await RRef.to_here(module)  # on the owner: the module itself, once built
    return [RRef(p) for p in built.parameters(recurse)]


async def _set_training(module: RRef[torch.nn.Module], mode: bool) -> None:
    (await RRef.to_here(module)).train(mode)


class RemoteModule:
    """A module built on another worker; ``remote_device`` is ``"worker/device"``
    (``"ps/cpu"``, ``"ps/cuda:0"``) or just ``"worker"`` (cpu)."""

    def __init__(
        self,
        remote_device: str,
        module_cls: type[torch.nn.Module],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        worker, _, device = remote_device.partition("/")
        self.worker = worker
        self.device = device or "cpu"
        self.module_rref: RRef[torch.nn.Module] = remote(
            worker, _build, (module_cls, args, kwargs or {}, self.device)
        )

    def forward_async(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Run the module's forward on its worker; a future of the output."""
        future: asyncio.Future[Any] = RRef.rpc_async(self.module_rref).__call__(*args, **kwargs)
        return future

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The blocking form of :meth:`forward_async`, for threads other than the loop's."""
        return RRef.rpc_sync(self.module_rref).__call__(*args, **kwargs)

    async def remote_parameters(self, recurse: bool = True) -> list[RRef[torch.Tensor]]:
        """RRefs of the module's parameters (for ``DistributedOptimizer``)."""
        owner = self.module_rref
        return await owner._context.agent.rpc_async(  # type: ignore[no-any-return]
            self.worker, _parameter_rrefs, (owner, recurse)
        )

    def get_module_rref(self) -> RRef[torch.nn.Module]:
        """The RRef of the module itself."""
        return self.module_rref

    def train(self, mode: bool = True) -> asyncio.Future[None]:
        """Set training mode on the remote module; a future of when it is done."""
        owner = self.module_rref
        return owner._context.agent.rpc_async(self.worker, _set_training, (owner, mode))

    def eval(self) -> asyncio.Future[None]:
        """``train(False)``."""
        return self.train(False)
