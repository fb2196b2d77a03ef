"""Distributed autograd contexts: what each worker records during a forward pass.

Theory of operation
-------------------
A context is identified by an id made on the worker that opened it and known
to every worker its RPCs reach.  While a context is current (a context
variable), every tensor that requires grad and is pickled into an RPC message
-- in arguments or in a result -- is recorded as a *send* (the tensor itself,
with its graph, under a send id) and travels with ``(context id, send id,
sender)``.  The receiver rebuilds it as a fresh leaf that requires grad and
records it as a *recv*.  The context id also travels with every request made
while it is current (``agent.propagate``), so the callee runs inside the same
context: nested calls record too, and so do results sent back by calls that
carried no tensor (``to_here``, say).

Recording does not depend on how a tensor travels: the record wraps serde's own
reduction (strided and sparse tensors), or, for a tensor serde leaves to torch's
pickling (on a device other than cpu and cuda, say), torch's reduction of it
without its graph, and the receiver makes it a leaf that requires grad.  Gradients come
back in whatever layout the receiver's engine gives (a sparse tensor's are
usually sparse; so are an embedding table's with ``sparse=True``), and adding
two of them follows torch's AccumulateGrad (dense + sparse, not the reverse).

So a worker's part of the distributed graph is its local autograd graph, whose
leaves are its parameters and its recvs, and whose entry points for gradients
coming back are its sends.  The backward pass (:mod:`asyncrpc.autograd.engine`)
walks it piece by piece.  Gradients accumulate in the context (keyed by leaf
tensor), never in ``.grad``, so concurrent contexts do not mix.

Each context also remembers the workers it exchanged tensors with; releasing
a context releases it there too, transitively, so it is freed everywhere.  A
release is a one-way notice (:mod:`asyncrpc.agent.notices`) that names the
workers already covered, so none is told twice: no reply, and no message of its
own in a training loop, where it rides on the next step's first request.
Graceful shutdown sends what is queued before its own notices, so every release
is handled before anyone closes.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrpc.agent import RpcAgent, current_transfer, on_notice, propagate
from asyncrpc.errors import AgentStateError
from asyncrpc.serde import reduce_tensor, register_reducer

ContextId = int  # the opener's rank << _SERIAL_BITS | a serial there
SendId = tuple[int, int]  # (sender rank, serial there)
_SERIAL_BITS = 40


def opener_of(context_id: ContextId) -> int:
    """The rank of the worker that opened a context."""
    return context_id >> _SERIAL_BITS


log = logging.getLogger("asyncrpc.autograd")

current_context_id: contextvars.ContextVar[ContextId | None] = contextvars.ContextVar(
    "asyncrpc_autograd_context", default=None
)


@dataclass(eq=False)
class Recv:
    tensor: torch.Tensor
    sender: int
    send_id: SendId


@dataclass(eq=False)
class AutogradContext:
    """One worker's part of one distributed backward pass."""

    id: ContextId
    sends: dict[SendId, torch.Tensor] = field(default_factory=dict)
    recvs: dict[int, Recv] = field(default_factory=dict)  # id(tensor) -> Recv
    peers: set[int] = field(default_factory=set)  # ranks we exchanged tensors with
    grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    ddp: list[Any] = field(default_factory=list)  # DDP modules run here (autograd/ddp.py)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` arrived in an RPC of this context (a recv)."""
        with self.lock:
            recv = self.recvs.get(id(tensor))
        return recv is not None and recv.tensor is tensor

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            known = self.grads.get(leaf)
            self.grads[leaf] = grad if known is None else add_gradients(known, grad)


def add_gradients(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``first + second``, two gradients of one tensor in any layouts: torch adds a sparse
    gradient to a dense one only in the order dense + sparse (its AccumulateGrad swaps)."""
    if first.layout is not torch.strided and second.layout is torch.strided:
        return second + first
    return first + second


class AutogradContexts:
    """The agent extension holding a worker's live contexts."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.rank = agent.info.id
        self.live: dict[ContextId, AutogradContext] = {}
        self._serials = itertools.count(1)
        self._lock = threading.Lock()

    def new_context(self) -> AutogradContext:
        context_id = (self.rank << _SERIAL_BITS) | next(self._serials)
        return self.get_or_create(context_id)

    def get_or_create(self, context_id: ContextId) -> AutogradContext:
        with self._lock:
            found = self.live.get(context_id)
            if found is None:
                found = self.live[context_id] = AutogradContext(context_id)
            return found

    def get(self, context_id: ContextId) -> AutogradContext:
        found = self.live.get(context_id)
        if found is None:
            raise AgentStateError(
                f"no distributed autograd context {context_id} on worker "
                f"{self.agent.info.name!r} (released already, or never used here)"
            )
        return found

    def release(self, context_id: ContextId) -> AutogradContext | None:
        with self._lock:
            return self.live.pop(context_id, None)

    def new_send_id(self) -> SendId:
        return (self.rank, next(self._serials))

    def release_everywhere(
        self, context_id: ContextId, covered: frozenset[int] = frozenset()
    ) -> None:
        """Release ``context_id`` here and tell every worker it reached but those
        ``covered`` (already released, or told by someone else) to do the same."""
        released = self.release(context_id)
        if released is None:
            return
        peers = released.peers - covered - {self.rank}
        covered |= peers | {self.rank}
        for peer in sorted(peers):
            try:
                self.agent.notify(peer, RELEASE, context_id, sorted(covered))
            except Exception as exc:  # e.g. shutting down: the peer's close frees it
                log.warning("cannot release autograd context %d on %d: %s", context_id, peer, exc)

    async def released(self) -> None:
        """Wait until every worker told to release a context has done so (and has
        told those it reached in turn)."""
        await self.agent.notices_delivered()

    # -- agent extension -----------------------------------------------------------

    def peer_lost(self, rank: int) -> None:
        """Contexts a lost worker opened will never be released by it: free them here
        (a backward pass reaching a lost worker fails through its RPC)."""
        with self._lock:
            orphans = [c for c in self.live if opener_of(c) == rank]
            for context_id in orphans:
                del self.live[context_id]

    async def drain(self) -> None:
        pass  # releases are notices: the agent sends them before its shutdown notices

    def close(self) -> None:
        self.live.clear()

    def debug_info(self) -> dict[str, Any]:
        return {"autograd_contexts": len(self.live)}


def contexts_of(agent: RpcAgent) -> AutogradContexts:
    """The autograd contexts of ``agent`` (made on first use)."""
    return agent.extension("autograd", AutogradContexts)


RELEASE = "autograd.release"


def _on_release(agent: RpcAgent, sender: int, context_id: Any, covered: Any) -> None:
    """A worker that took part released ``context_id``: release it here, and tell the
    workers it reached here that are not ``covered`` yet."""
    if type(context_id) is not int or not isinstance(covered, list):
        raise ValueError(f"malformed release of an autograd context: {context_id!r}")
    contexts_of(agent).release_everywhere(context_id, frozenset(covered) | {sender})


on_notice(RELEASE, _on_release)


# -- recording sends and recvs as tensors are (un)pickled ----------------------------


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    context_id = current_context_id.get()
    transfer = current_transfer()
    default = reduce_tensor(tensor)
    if not tensor.requires_grad or context_id is None or transfer is None:
        return default
    rebuild, args = _reduced_by_torch(tensor) if default is NotImplemented else default
    contexts = contexts_of(transfer.agent)
    context = contexts.get_or_create(context_id)
    send_id = contexts.new_send_id()
    with context.lock:
        context.sends[send_id] = tensor
        context.peers.add(transfer.peer_rank)
    return _received, (context_id, send_id, contexts.rank, rebuild, args)


def _reduced_by_torch(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's own reduction of ``tensor`` without its graph, for a tensor that serde
    leaves to torch's pickling (on a device other than cpu or cuda, say): recorded all
    the same, it arrives as a leaf that :func:`_received` makes require grad."""
    reduce_ex: Callable[[int], tuple[Any, ...]] = tensor.detach().__reduce_ex__
    rebuild, args = reduce_ex(pickle.HIGHEST_PROTOCOL)[:2]
    return rebuild, args


def _received(
    context_id: ContextId, send_id: SendId, sender: int, rebuild: Any, args: tuple[Any, ...]
) -> torch.Tensor:
    tensor: torch.Tensor = rebuild(*args)
    if tensor.grad_fn is not None or not tensor.requires_grad:  # torch's rebuild, say
        tensor = tensor.detach().requires_grad_()
    transfer = current_transfer()
    if transfer is None:  # unpickled outside a message: just the tensor
        return tensor
    context = contexts_of(transfer.agent).get_or_create(context_id)
    with context.lock:
        context.recvs[id(tensor)] = Recv(tensor, sender, send_id)
        context.peers.add(sender)
    return tensor


propagate("autograd", current_context_id)
register_reducer(torch.Tensor, _reduce_tensor)
register_reducer(torch.nn.Parameter, _reduce_tensor)
