"""The distributed backward pass: a coroutine walk over every worker's local graph.

Theory of operation
-------------------
A *piece* is one run of the local autograd engine on one worker: from some
tensors (the roots, or the tensors this worker once sent) with their incoming
gradients, to every leaf reachable from them.  It runs in the worker's thread
pool, off the event loop, with ``torch.autograd.grad`` (the graph is retained:
a worker may be reached again, by another branch of the pass).  Each leaf's
gradient either accumulates in the context (parameters and other leaves) or,
for a leaf that is a *recv*, becomes the gradient its sender needs.

After a piece, the worker sends those gradients to each sender at once (one
RPC per sender), which runs its own piece from the matching sends, and so on.
Gradients that a piece owes the very worker that asked for it are not sent in
a call of their own: they travel back in the reply, and that worker runs the
piece they feed once the reply is in (a two-stage model's backward is then one
round trip, not two).  A worker replies when everything downstream of it has
replied, so the initiator's ``backward`` returns exactly when the whole
distributed pass is done, and any failure anywhere (an exception, a dead
worker) comes back up the chain to it.  This is FAST mode: gradients are not
merged across branches before a piece runs; since backward is linear, the
accumulated sums are the same.

A piece runs through ``agent.offload``: a training loop runs the same pieces
step after step, so a piece whose kind (its roots' shapes, dtypes and graph
nodes) proved quick runs on the event loop, sparing two thread hops, and any
other runs in the pool.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import torch

from asyncrpc.agent import RpcAgent, current_agent
from asyncrpc.autograd.context import AutogradContext, ContextId, SendId, contexts_of
from asyncrpc.errors import AgentStateError

Grads = list[tuple[SendId, torch.Tensor]]
Seeds = list[tuple[torch.Tensor, torch.Tensor]]


async def run_backward(
    agent: RpcAgent,
    context: AutogradContext,
    seeds: Seeds,
    requester: int | None = None,
) -> Grads:
    """Run a piece from ``seeds`` here, then the pieces it feeds, on every worker;
    returns the gradients the piece owes ``requester`` (not sent: see the module doc)."""
    outgoing = await agent.offload(_kind_of(seeds), _local_piece, context, seeds)
    back = outgoing.pop(requester, []) if requester is not None else []
    await _pass_on(agent, context, outgoing)
    return back


async def _pass_on(agent: RpcAgent, context: AutogradContext, outgoing: dict[int, Grads]) -> None:
    """Send each sender its gradients; run the piece fed by what comes back for us."""
    calls = [
        agent.rpc_async(
            sender,
            _backward_from_sends,
            (context.id, grads, agent.info.id),
            label=f"distributed backward of context {context.id}",
        )
        for sender, grads in outgoing.items()
    ]
    back: dict[SendId, torch.Tensor] = {}
    for grads in await asyncio.gather(*calls):
        for send_id, grad in grads:
            back[send_id] = back[send_id] + grad if send_id in back else grad
    if back:
        await run_backward(agent, context, [(context.sends[i], g) for i, g in back.items()])


def _kind_of(seeds: Seeds) -> tuple[Any, ...]:
    """What identifies a piece from one training step to the next."""
    return ("backward", *((tuple(t.shape), t.dtype, type(t.grad_fn)) for t, _ in seeds))


def _local_piece(context: AutogradContext, seeds: Seeds) -> dict[int, Grads]:
    """Local backward from ``seeds``; returns what each sender gets."""
    roots = [(t, g) for t, g in seeds if t.requires_grad]
    leaves = _reachable_leaves([t for t, _ in roots])
    if not leaves:
        return {}
    found = torch.autograd.grad(
        [t for t, _ in roots],
        leaves,
        grad_outputs=[g for _, g in roots],
        retain_graph=True,
        allow_unused=True,
    )
    outgoing: dict[int, Grads] = defaultdict(list)
    for leaf, grad in zip(leaves, found, strict=True):
        if grad is None:
            continue
        recv = context.recvs.get(id(leaf))
        if recv is not None and recv.tensor is leaf:
            outgoing[recv.sender].append((recv.send_id, grad))
        else:
            context.accumulate(leaf, grad)
    return dict(outgoing)


def _reachable_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf tensor requiring grad that the graph of ``roots`` reaches."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack = []
    for root in roots:
        if root.grad_fn is None:
            leaves[id(root)] = root
        else:
            stack.append(root.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return list(leaves.values())


async def _backward_from_sends(context_id: ContextId, grads: Grads, requester: int) -> Grads:
    """On a sender: continue the pass from the tensors it sent, with their gradients;
    returns the gradients this piece owes ``requester`` (see the module docstring)."""
    agent = current_agent()
    if agent is None:  # pragma: no cover - always runs inside an agent
        raise AgentStateError("distributed backward outside of a running agent")
    context = contexts_of(agent).get(context_id)
    seeds = [(context.sends[send_id], grad) for send_id, grad in grads]
    return await run_backward(agent, context, seeds, requester)
