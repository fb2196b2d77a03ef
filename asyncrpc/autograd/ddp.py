"""DistributedDataParallel inside distributed autograd contexts.

Theory of operation
-------------------
DDP averages gradients with hooks on its parameters' gradient accumulators,
which fire when a local backward accumulates into ``.grad``.  A distributed
backward here accumulates into the context instead (the engine runs the graph
as ``torch.autograd.grad`` does), so those hooks never fire, and a DDP forward
that prepared its reducer for them fails on the next iteration.  Replicas
would diverge silently.  So, while a distributed autograd context is current,
a DDP module's forward runs as under ``no_sync()`` and is noted in the context;
when the backward started on this worker is done, the gradients in the context
of each noted module's parameters are averaged over its process group: one flat
all-reduce per module, in parameter order, a parameter without a gradient
contributing zeros (as DDP does for unused parameters).  Every replica runs the
same steps, so they meet in the same collectives.  Global module hooks do the
noting; they are installed while a context is open in this process.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from asyncrpc.autograd.context import AutogradContext, ContextId, current_context_id

_SYNC_FLAG = "_asyncrpc_backward_grad_sync"


class _Hooks:
    """The global forward hooks, installed while ``users`` contexts are open."""

    def __init__(self) -> None:
        self.users = 0
        self.handles: list[RemovableHandle] = []
        self.lock = threading.Lock()


_hooks = _Hooks()


def opened(contexts: Any) -> None:
    """A context was opened here: note DDP forwards from now on (if DDP can run)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with _hooks.lock:
        _hooks.users += 1
        if _hooks.users == 1:
            nn = torch.nn.modules.module
            _hooks.handles = [
                nn.register_module_forward_pre_hook(lambda m, a: _before_forward(contexts, m)),
                nn.register_module_forward_hook(lambda m, a, o: _after_forward(m)),
            ]


def closed() -> None:
    """A context opened with :func:`opened` was left."""
    with _hooks.lock:
        if _hooks.users == 0:
            return
        _hooks.users -= 1
        if _hooks.users == 0:
            for handle in _hooks.handles:
                handle.remove()
            _hooks.handles = []


def _before_forward(contexts: Any, module: torch.nn.Module) -> None:
    context_id: ContextId | None = current_context_id.get()
    if context_id is None or not isinstance(module, DistributedDataParallel):
        return
    context: AutogradContext = contexts.get_or_create(context_id)
    with context.lock:
        if all(known is not module for known in context.ddp):
            context.ddp.append(module)
    setattr(module, _SYNC_FLAG, module.require_backward_grad_sync)
    module.require_backward_grad_sync = False  # as under no_sync(): we reduce instead


def _after_forward(module: torch.nn.Module) -> None:
    if isinstance(module, DistributedDataParallel) and hasattr(module, _SYNC_FLAG):
        module.require_backward_grad_sync = getattr(module, _SYNC_FLAG)
        delattr(module, _SYNC_FLAG)


async def average_gradients(context: AutogradContext) -> None:
    """Average, over each noted DDP module's group, its parameters' gradients in ``context``."""
    for module in list(context.ddp):
        params = _synced_parameters(module)
        with context.lock:
            grads = [context.grads.get(p) for p in params]
        flat = torch.cat(
            [
                torch.zeros(p.numel(), dtype=p.dtype) if g is None else g.reshape(-1)
                for p, g in zip(params, grads, strict=True)
            ]
        )
        group = module.process_group
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None
        await asyncio.to_thread(work.wait)
        flat /= dist.get_world_size(group)
        averaged = torch.split(flat, [p.numel() for p in params])
        with context.lock:
            for param, grad in zip(params, averaged, strict=True):
                context.grads[param] = grad.view_as(param)


def _synced_parameters(module: DistributedDataParallel) -> list[torch.Tensor]:
    ignored = module.parameters_to_ignore
    return [
        p for name, p in module.module.named_parameters() if p.requires_grad and name not in ignored
    ]
