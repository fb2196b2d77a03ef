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
other runs in the pool.  A piece that ran on the loop and feeds no other worker
is the whole of that worker's part: its gradients are ready on return, and the
reply leaves in the same loop turn as the request came (no task to schedule).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable
from typing import Any

import torch

from asyncrpc.agent import RpcAgent, async_execution, current_agent
from asyncrpc.autograd.context import (
    AutogradContext,
    ContextId,
    SendId,
    add_gradients,
    contexts_of,
)
from asyncrpc.errors import AgentStateError

# torch.autograd.grad's own way into the engine (see _grad); None if a torch moves it.
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)

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
    return await _after_piece(agent, context, _run_piece(agent, context, seeds), requester)


def _run_piece(
    agent: RpcAgent, context: AutogradContext, seeds: Seeds
) -> asyncio.Future[dict[int, Grads]]:
    return agent.offload(_kind_of(seeds), _local_piece, context, seeds)


async def _after_piece(
    agent: RpcAgent,
    context: AutogradContext,
    piece: asyncio.Future[dict[int, Grads]],
    requester: int | None,
) -> Grads:
    back, others = _split(await piece, requester)
    await _pass_on(agent, context, others)
    return back


def _split(outgoing: dict[int, Grads], requester: int | None) -> tuple[Grads, dict[int, Grads]]:
    """What a piece owes ``requester``, and what it owes every other sender."""
    others = {sender: grads for sender, grads in outgoing.items() if sender != requester}
    return outgoing.get(requester, []) if requester is not None else [], others


async def _pass_on(agent: RpcAgent, context: AutogradContext, outgoing: dict[int, Grads]) -> None:
    """Send each sender its gradients; run the piece fed by what comes back for us."""
    calls = [
        agent.rpc_async(
            sender,
            _backward_from_sends,
            (context.id, grads, agent.info.id),
            label="distributed backward",  # one metric series, not one per step
        )
        for sender, grads in outgoing.items()
    ]
    back: dict[SendId, torch.Tensor] = {}
    for grads in await asyncio.gather(*calls):
        for send_id, grad in grads:
            back[send_id] = add_gradients(back[send_id], grad) if send_id in back else grad
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
    found = _grad(roots, leaves)
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


def _grad(roots: Seeds, leaves: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(roots, leaves, their gradients, retain_graph=True,
    allow_unused=True)``, entering the engine where ``torch.autograd.grad`` itself does:
    its Python argument handling is a measurable part of a training step (see
    docs/architecture.md), and the engine checks the gradients' shapes again anyway."""
    outputs, grads = tuple(t for t, _ in roots), tuple(g for _, g in roots)
    if _engine_run_backward is None:  # pragma: no cover - a torch without it
        return torch.autograd.grad(outputs, leaves, grads, retain_graph=True, allow_unused=True)
    found: tuple[torch.Tensor | None, ...] = _engine_run_backward(
        outputs, grads, True, False, tuple(leaves), True, accumulate_grad=False
    )
    return found


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
        if type(node) is _ACCUMULATE_GRAD:  # a leaf's node, and the end of its path
            leaf: torch.Tensor = node.variable  # type: ignore[attr-defined]
            leaves[id(leaf)] = leaf
            continue
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)
    return list(leaves.values())


def _accumulate_grad_type() -> type:
    """The class of the graph node through which a leaf receives its gradient."""
    leaf = torch.zeros((), requires_grad=True)
    return type((leaf * 1).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


_ACCUMULATE_GRAD = _accumulate_grad_type()


@async_execution
def _backward_from_sends(context_id: ContextId, grads: Grads, requester: int) -> Awaitable[Grads]:
    """On a sender: continue the pass from the tensors it sent, with their gradients;
    what this piece owes ``requester`` (see the module docstring), already there when
    the piece ran on the loop and feeds no other worker."""
    agent = current_agent()
    if agent is None:  # pragma: no cover - always runs inside an agent
        raise AgentStateError("distributed backward outside of a running agent")
    context = contexts_of(agent).get(context_id)
    piece = _run_piece(agent, context, [(context.sends[i], grad) for i, grad in grads])
    if piece.done() and piece.exception() is None:
        back, others = _split(piece.result(), requester)
        if not others:
            finished: asyncio.Future[Grads] = agent.loop.create_future()
            finished.set_result(back)
            return finished
    return _after_piece(agent, context, piece, requester)
