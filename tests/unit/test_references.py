"""A call's function by name (serde.references): the same object pickle would find, at
both ends, or nothing for what pickle would not save by name."""

from __future__ import annotations

import functools
import math
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.serde import references
from asyncrpc.serde.references import reference, resolve

HERE = __name__


def module_level() -> str:
    return "module level"


class Holder:
    def method(self) -> str:
        return "method"

    @staticmethod
    def static() -> str:
        return "static"

    class Inner:
        @staticmethod
        def deep() -> str:
            return "deep"


def _unwrapped(fn: Callable[[], str]) -> Callable[[], str]:
    def wrapper() -> str:  # no functools.wraps: its name is not what names it
        return fn()

    return wrapper


renamed = _unwrapped(module_level)


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    references._by_function.clear()
    references._by_reference.clear()
    yield
    references._by_function.clear()
    references._by_reference.clear()


@pytest.mark.parametrize(
    ("fn", "qualname"),
    [
        (module_level, "module_level"),
        (Holder.method, "Holder.method"),
        (Holder.static, "Holder.static"),
        (Holder.Inner.deep, "Holder.Inner.deep"),
    ],
)
def test_a_function_found_by_its_name_travels_as_that_name(fn: Any, qualname: str) -> None:
    name = reference(fn)
    assert name == f"{HERE}:{qualname}"
    assert resolve(name) is fn
    assert resolve(name) is pickle.loads(pickle.dumps(fn))  # what pickle would find


@pytest.mark.parametrize(
    "fn",
    [
        lambda: None,
        _unwrapped(module_level),  # made in a function (<locals>)
        renamed,  # its qualname says wrapper: not what that name finds
        Holder().method,  # a bound method: pickled with its object
        functools.partial(module_level),
        math.sqrt,  # builtins pickle their own way
        torch.add,
        Holder,  # a class
        "module_level",
    ],
)
def test_anything_else_is_left_to_pickle(fn: Any) -> None:
    assert reference(fn) is None


def test_a_function_rebound_after_it_was_named_is_left_to_pickle() -> None:
    assert reference(module_level) is not None
    original = module_level
    globals()["module_level"] = lambda: "rebound"
    try:
        assert reference(original) is None  # pickle would refuse it: not the same object
    finally:
        globals()["module_level"] = original
    assert reference(original) == f"{HERE}:module_level"


def test_the_callee_finds_what_the_name_names_now_not_what_it_named_before() -> None:
    name = f"{HERE}:module_level"
    assert resolve(name) is module_level
    original = module_level
    globals()["module_level"] = replacement = lambda: "rebound"
    try:
        assert resolve(name) is replacement  # as unpickling would (no stale cache)
    finally:
        globals()["module_level"] = original


def test_a_module_not_imported_yet_is_imported_as_unpickling_would() -> None:
    sys.modules.pop("colorsys", None)
    found = resolve("colorsys:rgb_to_hsv")
    assert found is sys.modules["colorsys"].rgb_to_hsv


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (f"{HERE}:only_on_the_caller", "only_on_the_caller"),
        ("no_such_module_anywhere:f", "no_such_module_anywhere"),
        (f"{HERE}:Holder.missing", "missing"),
    ],
)
def test_a_function_missing_here_says_code_does_not_travel(name: str, says: str) -> None:
    with pytest.raises(SerializationError) as info:
        resolve(name)
    message = str(info.value)
    assert says in message
    assert "does not serialize function code" in message
    assert "define them on both caller and callee" in message


@pytest.mark.parametrize(
    "name",
    ["", "no colon", ":f", f"{HERE}:", f"{HERE}:Holder..method", f"{HERE}:f.<locals>.g", 7, None],
)
def test_a_malformed_name_is_refused(name: Any) -> None:
    with pytest.raises(SerializationError, match="malformed function name"):
        resolve(name)
    assert name not in references._by_reference  # nothing kept for it


def test_both_caches_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(references, "_KEPT", 2)
    for fn in (module_level, Holder.method, Holder.static):
        resolve(reference(fn))
    assert len(references._by_function) <= 2
    assert len(references._by_reference) <= 2
    assert resolve(reference(Holder.Inner.deep)) is Holder.Inner.deep
