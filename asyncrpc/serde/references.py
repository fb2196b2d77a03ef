"""A call's function by name, beside its pickled arguments rather than inside them.

Theory of operation
-------------------
pickle saves a module-level function as its module and qualified name, and finds it
again by importing the module and walking the name's attributes.  On Python 3.11 both
ends go through the import machinery for that, which raises and clears an
``AttributeError`` each time (``ModuleSpec._initializing``): about a microsecond at
each end of every call in a tight loop, and over ten when the caches are cold, as they
are between the steps of a training job.

So a call's function that pickle would save by name travels as that name instead:
:func:`reference` gives the caller ``"module:qualname"`` (None for any other callable,
which then pickles with the arguments as before), and :func:`resolve` gives the callee
the object that name names.  Both look the name up as pickle does -- the module in
``sys.modules`` (imported if it is not there yet), then ``getattr`` along the
qualified name -- and both do it on every call, so a function rebound meanwhile is
found as pickle would find it, and one that is not what its name names (a decorator
that did not copy ``__qualname__``, say) is left to pickle.  What is kept between calls
is only the parsed name, in caches bounded like dispatch's.
"""

from __future__ import annotations

import importlib
import sys
from types import FunctionType, ModuleType
from typing import Any

from asyncrpc.errors import SerializationError

_KEPT = 1024  # names kept parsed at each end (forgotten all at once past this)
_by_function: dict[FunctionType, tuple[str, str, tuple[str, ...]]] = {}
_by_reference: dict[str, tuple[str, tuple[str, ...]]] = {}

BY_REFERENCE = (
    "the RPC pickler does not serialize function code: functions and classes travel by "
    "module and name, so define them on both caller and callee"
)


def reference(fn: Any) -> str | None:
    """``"module:qualname"`` if ``fn`` is a function that name finds here (as pickle
    would save it), else None."""
    if type(fn) is not FunctionType:
        return None
    entry = _by_function.get(fn)
    if entry is None:
        module, qualname = fn.__module__, fn.__qualname__
        if type(module) is not str or "<" in qualname:  # a lambda, or made in a function
            return None
        entry = (f"{module}:{qualname}", module, tuple(qualname.split(".")))
        if len(_by_function) >= _KEPT:
            _by_function.clear()
        _by_function[fn] = entry
    name, module, path = entry
    try:
        found = _walk(sys.modules[module], path)
    except (KeyError, AttributeError):
        return None
    return name if found is fn else None


def resolve(name: Any) -> Any:
    """What ``"module:qualname"`` names here, found as unpickling would find it; a
    SerializationError if nothing is."""
    entry = _by_reference.get(name) if type(name) is str else None
    if entry is None:
        entry = _parse(name)
        if len(_by_reference) >= _KEPT:
            _by_reference.clear()
        _by_reference[name] = entry
    module_name, path = entry
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        return _walk(module, path)
    except Exception as exc:
        raise SerializationError(f"cannot find function {name!r}: {exc!r}; {BY_REFERENCE}") from exc


def _parse(name: Any) -> tuple[str, tuple[str, ...]]:
    module, _, qualname = name.partition(":") if type(name) is str else ("", "", "")
    path = tuple(qualname.split("."))
    if not module or not all(path) or any("<" in part for part in path):
        raise SerializationError(f"malformed function name {name!r}")
    return module, path


def _walk(module: ModuleType, path: tuple[str, ...]) -> Any:
    found: Any = module
    for part in path:
        found = getattr(found, part)
    return found
