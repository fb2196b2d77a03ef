"""``torch.distributed.autograd`` on asyncrpc: ``import asyncrpc.compat.autograd as dist_autograd``.

Theory of operation
-------------------
``context()`` is a plain context manager yielding an int id.  It opens a native
distributed autograd context and makes it current in the calling thread (the
native context variable); compat calls started by this thread carry it (see
:mod:`asyncrpc.compat._runtime`), so RPCs record and the callees' nested calls
run in the same context, as in torch.  Leaving it releases the context
everywhere, on the loop.  ``backward`` runs the native backward pass and blocks;
``get_gradients`` reads this worker's gradients of a context.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any

import torch

import asyncrpc.autograd as native
from asyncrpc.autograd.context import AutogradContext, contexts_of, current_context_id
from asyncrpc.compat import _runtime
from asyncrpc.compat._private import private_getattr

__all__ = ("backward", "context", "get_gradients")

__getattr__ = private_getattr("torch.distributed.autograd")


class context:  # noqa: N801  # torch's name
    """``with dist_autograd.context() as context_id:`` a distributed autograd context
    for this thread, released everywhere on leaving."""

    def __init__(self) -> None:
        self._token: Any = None
        self._id: int | None = None

    def __enter__(self) -> int:
        agent = _runtime.agent()
        if current_context_id.get() is not None:
            raise RuntimeError(
                "Already have an autograd context id for this thread "
                f"({current_context_id.get()}); contexts do not nest"
            )
        opened = contexts_of(agent).new_context()
        self._id = opened.id
        self._token = current_context_id.set(opened.id)
        return opened.id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        current_context_id.reset(self._token)
        contexts = contexts_of(_runtime.agent())
        context_id = self._id
        assert context_id is not None
        _runtime.call(lambda: contexts.release_everywhere(context_id), "dist_autograd.context")


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass from the scalar ``roots`` across every worker involved;
    gradients accumulate in the context (:func:`get_gradients`).  Blocks."""
    _check_types(context_id, roots)
    _retrieve_context(context_id)
    run_engine(
        lambda: native.backward(context_id, list(roots), retain_graph), "dist_autograd.backward"
    )


def _check_types(context_id: object, roots: object) -> None:
    """What torch's binding refuses before anything runs: an int id, a list of tensors."""
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise TypeError(
            "backward(): incompatible function arguments: context_id must be an int, "
            f"not {type(context_id).__name__}"
        )
    if not isinstance(roots, (list, tuple)) or not all(
        isinstance(root, torch.Tensor) for root in roots
    ):
        raise TypeError(
            "backward(): incompatible function arguments: roots must be a list of tensors, "
            f"not {type(roots).__name__}"
        )


def run_engine(start: Callable[[], Awaitable[None]], what: str) -> None:
    """Run a native backward pass and block; like torch's engine, report every failure
    as a ``RuntimeError`` (naming the node where it happened)."""
    try:
        _runtime.run(start, what)
    except RuntimeError:
        raise
    except Exception as exc:
        raise RuntimeError(f"Error on Node {_node_of(exc)}: {exc}") from exc


def _node_of(error: BaseException) -> int:
    """The rank of the worker where ``error`` was raised (torch's "Node")."""
    agent = _runtime.agent()
    worker = getattr(error, "remote_worker", None)
    return agent.info.id if worker is None else agent.resolve(worker).rank


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients in the context: ``{tensor: gradient}``."""
    _retrieve_context(context_id)
    return native.get_gradients(context_id)


def _current_context() -> AutogradContext:
    """This thread's current context (torch's private helper)."""
    found = current_context_id.get()
    if found is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context")
    return _retrieve_context(found)


def _retrieve_context(context_id: int) -> AutogradContext:
    """The context of that id on this worker (torch's private helper)."""
    found = contexts_of(_runtime.agent()).live.get(context_id)
    if found is None:
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")
    return found


def _is_valid_context(context_id: int) -> bool:
    """Whether this worker knows the context."""
    return context_id in contexts_of(_runtime.agent()).live
