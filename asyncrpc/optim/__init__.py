"""DistributedOptimizer: one local optimizer per parameter owner, stepped per context.

Theory of operation
-------------------
The constructor groups the parameter RRefs by owner and creates, with
``remote()``, one :class:`_LocalOptimizer` on each owner around that owner's
parameters (any ``torch.optim`` optimizer class; it does not block).
``await step(ctx_id)`` asks every owner at once to step with the context's
gradients, under a lock, so steps on one owner are serialised (many trainers may
share one parameter server; as in torch, one lock serves every optimizer of a
process, since two optimizers may hold the same parameters).  It runs in the
owner's thread pool, or on its loop once steps proved quick (``agent.offload``).

As ``torch.distributed.optim.DistributedOptimizer`` does, an optimizer class
with a functional twin in torch (SGD, Adam, AdamW, Adagrad, ...; TorchScript
classes that take the gradients as a list) steps through the twin when the
arguments are keywords it takes: no ``.grad`` set and cleared, no profiler
record or hooks, the loop over parameters in C++ (the class's per-step Python
had been most of the optimizer's time; docs/architecture.md has the figure).
Any other optimizer, positional arguments,
or a torch without the twins use the class itself, each parameter's ``.grad``
set from the context for the step and cleared after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncrpc.agent import async_execution, current_agent
from asyncrpc.autograd import get_gradients
from asyncrpc.rref import RRef, remote

__all__ = ("DistributedOptimizer",)

Grads = list[torch.Tensor | None]


def _stepper(
    optimizer_class: type[torch.optim.Optimizer],
    params: list[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Callable[[Grads], None]:
    """One step of ``optimizer_class`` over ``params``, given their gradients: through
    its functional twin where there is one for these arguments (see the module
    docstring), else through the class."""
    optimizer = optimizer_class(params, *args, **kwargs)  # bad arguments raise as in torch
    twin_step = _twin_step(optimizer_class, params, args, kwargs)
    if twin_step is not None:
        return twin_step

    def step_with_grads(grads: Grads) -> None:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        try:
            optimizer.step()
        finally:
            for param in params:
                param.grad = None

    return step_with_grads


def _twin_step(
    optimizer_class: type[torch.optim.Optimizer],
    params: list[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Callable[[Grads], None] | None:
    twin = _functional_twins().get(optimizer_class)
    if twin is None or args or not set(kwargs) <= _keywords(twin):
        return None
    try:
        with _scripting_deprecation_unshown():
            step: Callable[[Grads], None] = twin(
                params, **kwargs, _allow_empty_param_list=True
            ).step
    except Exception:  # an argument the twin types differently (foreach=None, say)
        return None
    return step


@functools.cache
def _functional_twins() -> dict[type, Any]:
    """torch.distributed.optim's functional optimizers, by the class each stands for.
    Imported on first use: the import scripts them all (~0.6 s) and warns, once per
    class, that TorchScript is deprecated."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch.distributed.optim.utils import functional_optim_map  # noqa: PLC0415
    except ImportError:  # a torch built without torch.distributed
        return {}
    return dict(functional_optim_map)


_SCRIPTING_DEPRECATED = "`TorchScript` support for functional optimizers is deprecated"


@contextlib.contextmanager
def _scripting_deprecation_unshown() -> Iterator[None]:
    """Making a functional twin warns that TorchScript support for them is deprecated,
    and forces that warning past every filter.  It is ours to heed, not our users' (the
    class itself takes over once torch drops the twins), so it is not shown."""
    shown = warnings.showwarning

    def show(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if not str(message).startswith(_SCRIPTING_DEPRECATED):
            shown(message, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _keywords(cls: type) -> set[str]:
    parameters = inspect.signature(cls).parameters
    return {name for name in parameters if name != "params" and not name.startswith("_")}


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
        self.params = [RRef.local_value(p) for p in params]
        self._step_with = _stepper(optimizer_class, self.params, args, kwargs)

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
            self._step_with([grads.get(param) for param in self.params])


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

    async def created(self) -> None:
        """Wait until every owner has made its optimizer; raises the error of one that
        could not (an argument ``optimizer_class`` refuses, say), which the first
        :meth:`step` would raise otherwise."""
        await asyncio.gather(*(_made(opt) for opt in self.local_optimizers))

    async def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id`` (at once:
        the requests to other owners leave before this worker's own step, which may run
        on the loop right away)."""
        await asyncio.gather(
            *(RRef.rpc_async(opt).step(context_id) for opt in self.local_optimizers)
        )


async def _made(rref: RRef[Any]) -> None:
    """Wait until the value of ``rref`` (from ``remote()``) is made, without fetching it."""
    if rref.is_owner():
        await asyncio.shield(rref._context.value_of(rref._id))
    elif rref._creation is not None:
        await asyncio.shield(rref._creation)
