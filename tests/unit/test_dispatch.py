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


class UnhashableCallable:
    __hash__ = None  # type: ignore[assignment]

    async def __call__(self) -> int:
        return 3


def test_an_unhashable_callable_is_described_every_time_without_a_cache() -> None:
    callable_object = UnhashableCallable()
    assert describe(callable_object) == describe(callable_object)
    assert describe(callable_object)[0] is Placement.LOOP


def test_the_names_kept_of_python_functions_are_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(dispatch, "_names", {})
    monkeypatch.setattr(dispatch, "_NAMES_KEPT", 3)

    def make(index: int) -> Any:
        def named() -> int:
            return index

        return named

    made = [make(i) for i in range(5)]  # (closures: each call of make() a new function)
    names = [dispatch.function_name(fn) for fn in made]
    assert names == [f"{__name__}.{make.__qualname__}.<locals>.named"] * 5
    assert len(dispatch._names) <= 3
    assert dispatch.function_name(made[4]) is dispatch._names[made[4]]  # kept
