"""DistributedOptimizer: one local optimizer per parameter owner, stepped per context.

Theory of operation
-------------------
The constructor groups the parameter RRefs by owner and creates, with
``remote()``, one :class:`_LocalOptimizer` on each owner around that owner's
parameters (any ``torch.optim`` optimizer class; it does not block).
``await step(ctx_id)`` asks every owner at once to step: the owner sets each
parameter's ``.grad`` from the context's gradients, steps, and clears ``.grad``
again, under a lock, so steps on one owner are serialised (many trainers may
share one parameter server; as in torch, one lock serves every optimizer of a
process, since two optimizers may hold the same parameters).  It runs in the
owner's thread pool, or on its loop once steps proved quick (``agent.offload``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Any

import torch

from asyncrpc.agent import async_execution, current_agent
from asyncrpc.autograd import get_gradients
from asyncrpc.rref import RRef, remote

__all__ = ("DistributedOptimizer",)


class _LocalOptimizer:
    """Lives on a parameter owner: one torch optimizer over that owner's parameters."""

    lock = threading.Lock()  # every step in this process: parameters may be shared

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: list[RRef[torch.Tensor]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.params = [p.local_value() for p in params]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    @async_execution
    def step(self, context_id: int) -> asyncio.Future[None]:
        agent = current_agent()
        assert agent is not None  # a method called through an RRef runs in an agent
        if self.lock.locked():  # a step runs in the pool: never wait for it on the loop
            return agent.invoke(self._step, (context_id,))
        return agent.offload(("optimizer step", id(self)), self._step, context_id)

    def _step(self, context_id: int) -> None:
        grads = get_gradients(context_id)
        with self.lock:
            for param in self.params:
                param.grad = grads.get(param)
            self.optimizer.step()
            for param in self.params:
                param.grad = None


class DistributedOptimizer:
    """Any ``torch.optim`` optimizer over parameters that live on several workers.

    ``params_rref`` lists RRefs of the parameters (for instance from
    ``RemoteModule.remote_parameters()``, or ``RRef(p)`` for local ones); the
    extra arguments go to ``optimizer_class`` on each owner.  Create it on the
    event loop thread.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: list[RRef[torch.Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        by_owner: dict[int, list[RRef[torch.Tensor]]] = defaultdict(list)
        for param in params_rref:
            by_owner[param.owner().id].append(param)
        here = current_agent()
        mine = here.info.id if here is not None else None
        owners = sorted(by_owner, key=lambda owner: owner == mine)  # ours last: see step()
        self.local_optimizers: list[RRef[_LocalOptimizer]] = [
            remote(owner, _LocalOptimizer, (optimizer_class, by_owner[owner], args, kwargs))
            for owner in owners
        ]

    async def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id`` (at once:
        the requests to other owners leave before this worker's own step, which may run
        on the loop right away)."""
        await asyncio.gather(*(opt.rpc_async().step(context_id) for opt in self.local_optimizers))
