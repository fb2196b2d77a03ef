"""Where a function runs (dispatch.describe), without an event loop."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from asyncrpc.agent import dispatch
from asyncrpc.agent.dispatch import Placement, async_execution, describe


class AsyncCallable:
    async def __call__(self) -> int:
        return 1


def test_a_class_with_async_call_is_constructed_in_the_pool() -> None:
    assert describe(AsyncCallable)[0] is Placement.THREAD
    assert describe(AsyncCallable())[0] is Placement.LOOP


def test_bound_builtin_methods_are_not_kept_alive_by_the_cache() -> None:
    tensor = torch.ones(3)
    alive = weakref.ref(tensor)
    assert describe(tensor.add_)[0] is Placement.THREAD
    del tensor
    gc.collect()
    assert alive() is None


def test_plain_builtins_are_cached() -> None:
    assert describe(torch.add) == (Placement.THREAD, "torch._VariableFunctionsClass.add")
    assert torch.add in dispatch._placements


class Service:
    def plain(self) -> int:
        return 1

    async def coroutine(self) -> int:
        return 2

    @async_execution
    def batched(self) -> Any:
        return None


def test_python_methods_run_as_their_functions_and_are_not_kept_alive() -> None:
    service = Service()
    alive = weakref.ref(service)
    assert describe(service.plain) == (Placement.THREAD, f"{__name__}.Service.plain")
    assert describe(service.coroutine)[0] is Placement.LOOP
    assert describe(service.batched)[0] is Placement.AWAITABLE
    del service
    gc.collect()
    assert alive() is None  # the cache holds the functions, not the instance
