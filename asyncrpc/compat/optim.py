"""``torch.distributed.optim.DistributedOptimizer`` on asyncrpc (blocking ``step``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import asyncrpc.optim as native
from asyncrpc.compat import _runtime
from asyncrpc.compat.autograd import _retrieve_context
from asyncrpc.rref import RRef as NativeRRef

__all__ = ("DistributedOptimizer",)


class DistributedOptimizer:
    """Any ``torch.optim`` optimizer over parameters that live on several workers
    (torch's signature).  The constructor waits, as torch's does, until every owner
    has made its optimizer, and raises the error of one that could not (except on the
    event loop thread, which must not block: there the first step raises it);
    ``step(context_id)`` blocks until every owner stepped."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Sequence[NativeRRef[torch.Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._native: native.DistributedOptimizer = _runtime.call(
            lambda: native.DistributedOptimizer(
                optimizer_class, list(params_rref), *args, **kwargs
            ),
            "DistributedOptimizer()",
        )
        if not _runtime.running().on_loop_thread():
            _runtime.run(self._native.created, "DistributedOptimizer()")

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id``."""
        _retrieve_context(context_id)
        _runtime.run(lambda: self._native.step(context_id), "DistributedOptimizer.step")
