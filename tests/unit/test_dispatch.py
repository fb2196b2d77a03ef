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
    assert torch.add in dispatch._described


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


def named_here() -> int:
    return 0


def test_functions_made_at_run_time_are_never_kept_with_what_they_close_over() -> None:
    tensor = torch.ones(3)
    alive = weakref.ref(tensor)
    closure = _lambda_over(tensor)
    nested = _nested(tensor)
    assert describe(closure) == (Placement.THREAD, f"{__name__}._lambda_over.<locals>.<lambda>")
    assert dispatch.function_name(nested) == f"{__name__}._nested.<locals>.named"
    assert closure not in dispatch._described and nested not in dispatch._described
    del tensor, closure, nested
    gc.collect()
    assert alive() is None


def _lambda_over(t: torch.Tensor) -> Any:
    return lambda: t.sum() + 1


def _nested(t: torch.Tensor) -> Any:
    def named() -> Any:
        return t

    return named


def test_named_functions_are_kept_with_their_name_and_the_cache_is_bounded(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(dispatch, "_described", {})
    monkeypatch.setattr(dispatch, "_KEPT", 3)
    assert dispatch.function_name(named_here) == f"{__name__}.named_here"
    assert dispatch._described[named_here] == (Placement.THREAD, f"{__name__}.named_here")
    for builtin in (len, abs, max, min, sum):
        describe(builtin)
    assert len(dispatch._described) <= 3
    assert describe(sum) is dispatch._described[sum]  # the newest stays kept
