"""Where a function runs (dispatch.describe), without an event loop."""

from __future__ import annotations

import gc
import weakref

import torch

from asyncrpc.agent.dispatch import Placement, describe


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
    assert describe(torch.add) is describe(torch.add)
