"""Distributed autograd: contexts, a backward pass across workers, per-context gradients.

```python
async with asyncrpc.autograd.context() as ctx_id:
    loss = await forward_that_calls_other_workers(batch)
    await asyncrpc.autograd.backward(ctx_id, [loss])
    grads = asyncrpc.autograd.get_gradients(ctx_id)  # {tensor: gradient}, this worker's
```

See :mod:`asyncrpc.autograd.context` (recording) and :mod:`asyncrpc.autograd.engine`
(the backward pass).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import torch

from asyncrpc.agent import RpcAgent, current_agent
from asyncrpc.autograd import ddp
from asyncrpc.autograd.context import (
    AutogradContext,
    ContextId,
    contexts_of,
    current_context_id,
)
from asyncrpc.autograd.engine import run_backward
from asyncrpc.errors import AgentStateError
from asyncrpc.rref.handle import RRef, set_backward

__all__ = ("backward", "context", "get_gradients")


@asynccontextmanager
async def context() -> AsyncIterator[ContextId]:
    """Open a distributed autograd context; yields its id.

    While it is open, RPCs from this task that carry tensors requiring grad (in
    arguments or results) are recorded so that :func:`backward` can cross them.
    Leaving it releases the context here at once and on every worker that took
    part without waiting for them (graceful shutdown does).
    """
    agent = _agent()
    contexts = contexts_of(agent)
    opened = contexts.new_context()
    token = current_context_id.set(opened.id)
    ddp.opened(contexts)
    try:
        yield opened.id
    finally:
        ddp.closed()
        current_context_id.reset(token)
        contexts.release_everywhere(opened.id)


async def backward(
    context_id: ContextId, roots: Sequence[torch.Tensor], retain_graph: bool = False
) -> None:
    """Run the backward pass from the scalar ``roots`` (on this worker) across every
    worker involved; returns when it is done everywhere.  Gradients accumulate in the
    context (see :func:`get_gradients`), not in ``.grad``.

    Graphs are kept until the context is released (``retain_graph`` is accepted for
    compatibility: a context may be backpropagated again until it closes).
    DistributedDataParallel modules run in the context on this worker get their
    gradients averaged over their group, as a local backward would (see
    :mod:`asyncrpc.autograd.ddp`).
    """
    agent = _agent()
    context = contexts_of(agent).get(context_id)
    _check_roots(roots, context)
    await run_backward(agent, context, [(root, torch.ones_like(root)) for root in roots])
    await ddp.average_gradients(context)


def _check_roots(roots: Sequence[torch.Tensor], context: AutogradContext) -> None:
    """Refuse roots a backward pass cannot start from (in torch's words).  A tensor that
    arrived in an RPC of this context is a leaf here but not in torch, where it has a
    recv function: the pass may start from it (a loss computed remotely), and its
    gradient goes back to its sender."""
    if not roots:
        raise ValueError("No tensors provided for gradient computation (roots is empty)")
    for index, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward root {index} is a {type(root).__name__}, not a tensor")
        if not root.requires_grad:
            raise ValueError(f"requires_grad not set on backward root {index}")
        if root.numel() != 1:
            raise ValueError(
                f"backward root {index} of shape {tuple(root.shape)} is not a scalar, all "
                "roots need to be scalar"
            )
        if root.grad_fn is None and not context.received(root):
            raise ValueError(
                f"backward root {index} is a leaf: it does not have a valid gradient function"
            )


def get_gradients(context_id: ContextId) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients in the context: ``{leaf tensor: gradient}``."""
    context = contexts_of(_agent()).get(context_id)
    with context.lock:
        return dict(context.grads)


def _agent() -> RpcAgent:
    agent = current_agent()
    if agent is None:
        raise AgentStateError("RPC is not initialised: call `await asyncrpc.init_rpc(...)` first")
    return agent


async def _rref_backward(rref: RRef[torch.Tensor], context_id: ContextId) -> None:
    """RRef.backward, on the owner: backward from the RRef's scalar value (once made)."""
    value = await RRef.to_here(rref)
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"RRef should contain a tensor for .backward(), {rref!r} holds a {type(value).__name__}"
        )
    await backward(context_id, [value])


set_backward(_rref_backward)
