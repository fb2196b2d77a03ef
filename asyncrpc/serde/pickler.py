"""Values <-> (payload, buffers): pickle protocol 5 with tensor storages out of band.

Theory of operation
-------------------
``dumps`` pickles any value with protocol 5.  A tensor reduces to
``load_tensor(meta, PickleBuffer(bytes))``; the pickler's ``buffer_callback``
collects each PickleBuffer instead of writing it into the stream, so tensor
bytes do not enter the payload: they become separate wire buffers, passed as
zero-copy memoryviews (up to ``OUT_OF_BAND_MAX`` small ones a message: each has a
descriptor in the frame's header, and past that many a small one is copied into the
payload, where the receiver's unpickler finds it in a bytearray).  ``loads`` hands
the received buffer objects (fresh uint8 storage or shared-memory mappings) back to
pickle, which passes each one unchanged to ``load_tensor``.

Functions and classes pickle by reference (module and qualified name), as in
torch.distributed.rpc, so ``torch.add`` or ``mymodule.train_step`` travel as
names.  Unpickling can run code, which is why the transport authenticates every
peer before a single payload byte is unpickled.

Upper layers register extra reducers (RRefs, for instance) with
:func:`register_reducer`, so this layer never imports them.

No view of a ``PickleBuffer`` ever leaves this module.  On Python 3.11 the cyclic
garbage collector can crash the interpreter when a memoryview exported by a
PickleBuffer is caught in a reference cycle (CPython gh-77894): a failed call's
traceback easily holds its request's buffers in one.  So the buffer callback
hands out the tensor's own byte view, which :func:`reduce_tensor` registered under
the PickleBuffer it wrapped.  A PickleBuffer it does not know (another library's
``__reduce_ex__``) is written into the stream: the receiver could not read it
from tensor storage anyway.  numpy arrays take the tensor path
(:mod:`asyncrpc.serde.arrays`), and sparse tensors travel as their strided parts
(:mod:`asyncrpc.serde.sparse`).  CUDA tensors travel by the route of the message
they ride in (:mod:`asyncrpc.serde.cuda`, :mod:`asyncrpc.serde.devices`).
"""

from __future__ import annotations

import functools
import io
import pickle
import reprlib
import threading
from collections.abc import Callable, Sequence
from types import FunctionType
from typing import Any, Final, Self

import numpy as np
import torch

from asyncrpc.errors import AsyncRPCError, SerializationError
from asyncrpc.serde import cuda
from asyncrpc.serde.arrays import reduce_ndarray
from asyncrpc.serde.references import BY_REFERENCE
from asyncrpc.serde.sparse import dump_sparse, load_sparse
from asyncrpc.serde.tensors import (
    byte_view,
    dump_cuda_tensor,
    dump_tensor,
    load_ipc_tensor,
    load_tensor,
)

_REDUCERS: dict[type, Callable[[Any], Any]] = {}
_local = threading.local()  # per thread: the reusable pickler, the current dump's views


_PLAIN_TYPES: set[type] = {type(None), bool, int, float, complex, str, bytes, FunctionType}
"""Types whose instances pickle the same with or without our reducers (a function
pickles by reference); ``register_reducer`` takes its type out, ``register_plain`` adds
one."""
_PLAIN_ITEMS = 8
_PLAIN_DEPTH = 3
"""Containers a plain value nests, at most: ``(args, kwargs)`` holding an id pair, as
in ``((rref_id,), {})``."""
_NONE: Final = pickle.dumps(None, protocol=5)  # what most replies of a procedure are


def register_reducer(cls: type, reducer: Callable[[Any], Any]) -> None:
    """Make instances of exactly ``cls`` pickle as ``reducer(obj)`` on the wire (a
    ``(callable, args)`` pair, or ``NotImplemented`` for the default)."""
    _REDUCERS[cls] = reducer
    _PLAIN_TYPES.discard(cls)


def register_plain(cls: type) -> None:
    """Let instances of exactly ``cls`` travel in plain values (see :func:`dumps_plain`):
    for a small type of an upper layer that pickles by its own ``__reduce__`` into plain
    values, whatever pickler meets it (no reducer is registered for it)."""
    if cls in _REDUCERS:
        raise ValueError(f"{cls.__qualname__} has a reducer: it is not plain")
    _PLAIN_TYPES.add(cls)


def reduce_tensor(obj: Any) -> Any:
    """The out-of-band reduction of a plain tensor, strided or sparse (else
    ``NotImplemented``): for reducers registered for tensor types that fall back to the
    usual form."""
    if not isinstance(obj, torch.Tensor):
        return NotImplemented
    if obj.is_cuda:
        return _reduce_cuda(obj)
    dumped = dump_tensor(obj)
    if dumped is None:
        return _reduce_sparse(obj)
    meta, view = dumped
    return load_tensor, (meta, _out_of_band(view))


def _reduce_cuda(tensor: torch.Tensor) -> Any:
    """A CUDA tensor by the route of the message it rides in (see serde.cuda)."""
    dumped = dump_cuda_tensor(tensor, *cuda.destination())
    if dumped is None:
        return _reduce_sparse(tensor)
    meta, path, value = dumped
    if path == "ipc":
        return load_ipc_tensor, (meta, value)
    # (its host copy is being made: it leaves out of band, never copied into the payload)
    return load_tensor, (meta, _out_of_band(byte_view(value, value.numel()), staged=True))


def _reduce_sparse(tensor: torch.Tensor) -> Any:
    """A sparse tensor as its strided parts, which the pickler reduces in turn."""
    dumped = dump_sparse(tensor)
    if dumped is None:
        return NotImplemented
    return load_sparse, dumped


def _out_of_band(view: memoryview, *, staged: bool = False) -> pickle.PickleBuffer:
    """Wrap ``view`` for pickle, noting it so the buffer callback hands out ``view``
    itself rather than a view of the wrapper (see the module docstring).  ``staged``:
    its bytes are still being written (a CUDA tensor's host copy), so they must not be
    copied into the payload now."""
    buffer = pickle.PickleBuffer(view)
    views: dict[int, tuple[memoryview, bool]] | None = getattr(_local, "views", None)
    if views is not None:
        views[id(buffer)] = (view, staged)
    return buffer


OUT_OF_BAND_MAX: Final = 1024
"""Small buffers a message sends out of band, at most: each costs a few bytes of its
frame's header, which holds 64 KiB.  Past this many, one under ``IN_BAND_BELOW`` bytes
is copied into the payload instead (a value of 20,000 small tensors still travels);
larger ones always leave out of band (zero-copy, shared memory)."""
IN_BAND_BELOW: Final = 64 * 1024


def _collect(
    views: dict[int, tuple[memoryview, bool]],
    buffers: list[memoryview],
    buffer: pickle.PickleBuffer,
) -> bool:
    """The pickler's buffer callback: a buffer of ours leaves out of band as the view
    behind it, unless the message has ``OUT_OF_BAND_MAX`` already and it is small (and
    not staged); any other goes into the stream (a true answer tells pickle so)."""
    ours = views.pop(id(buffer), None)
    if ours is None:
        return True
    view, staged = ours
    if len(buffers) >= OUT_OF_BAND_MAX and view.nbytes < IN_BAND_BELOW and not staged:
        return True
    buffers.append(view)
    return False


register_reducer(
    np.ndarray,
    functools.partial(reduce_ndarray, reduce_tensor=reduce_tensor, out_of_band=_out_of_band),
)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:  # called for nearly every object
        reducer = _REDUCERS.get(type(obj))
        if reducer is not None:
            return reducer(obj)
        if not isinstance(obj, torch.Tensor):  # tuples, dicts, ...: pickle's own way
            return NotImplemented
        return reduce_tensor(obj)


class ReusablePickler:
    """A pickler's stream, kept per thread and rewound after each dump (building a
    pickler and its stream costs more than pickling a small call); ``busy`` guards
    against re-entry (an object whose ``__reduce__`` serialises: a pickler dumping again
    while it dumps crashes the interpreter).  Subclasses add their pickler."""

    def __init__(self) -> None:
        self.stream = io.BytesIO()
        self.busy = False

    @classmethod
    def of_this_thread(cls, local: threading.local) -> Self:
        """The one kept in ``local``, or a fresh one while that one is dumping."""
        found: Self | None = getattr(local, "reusable", None)
        if found is None:
            found = local.reusable = cls()
        return cls() if found.busy else found

    def rewind(self) -> None:
        """Ready for the next dump."""
        self.stream.seek(0)
        self.stream.truncate()
        self.busy = False


class _Reusable(ReusablePickler):
    """``dumps``' pickler.  Everything is reset *after* each dump: a pickler's memo holds
    strong references to what it pickled, which must not outlive the call.  No reference
    cycle either (the callback is a partial over plain containers), so nothing here
    waits for the cyclic GC.  The views registered by :func:`_out_of_band` are this
    dump's own."""

    def __init__(self) -> None:
        super().__init__()
        self.views: dict[int, tuple[memoryview, bool]] = {}
        self.buffers: list[memoryview] = []
        collect = functools.partial(_collect, self.views, self.buffers)
        self.pickler = _Pickler(self.stream, protocol=5, buffer_callback=collect)

    def dump(self, value: Any) -> tuple[bytes, list[memoryview]]:
        self.busy = True
        outer, _local.views = getattr(_local, "views", None), self.views
        try:
            self.pickler.dump(value)
            return self.stream.getvalue(), list(self.buffers)
        finally:
            _local.views = outer
            self.pickler.clear_memo()
            self.views.clear()
            self.buffers.clear()
            self.rewind()


def dumps_plain(value: Any) -> bytes | None:
    """The payload of a value no reducer has a part in (built-in scalars, functions, and
    small tuples, lists and str-keyed dicts of them, like most small calls and their
    replies), pickled by the C pickler alone; None for any other value (use ``dumps``).
    Here a no-op call's request takes 1.8 -> 1.4 µs and a None reply 0.97 -> 0.29 µs (and
    0.05 µs since None's pickle is kept)."""
    if value is None:
        return _NONE
    if not _plain(value, 0):
        return None
    try:
        return pickle.dumps(value, protocol=5)
    except Exception as exc:  # a function pickle cannot find by its name, say
        raise SerializationError(f"cannot serialize {_describe(value)}: {exc}") from exc


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain (see :func:`dumps_plain`): small and quick to pickle,
    a microsecond or two, wherever that happens."""
    return _plain(value, 0)


def _plain(value: Any, depth: int) -> bool:
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return True
    if depth == _PLAIN_DEPTH:
        return False
    if kind is dict:
        if len(value) > _PLAIN_ITEMS:
            return False
        for key in value:  # (a loop costs less than all()'s generator)
            if type(key) is not str:
                return False
        value = value.values()
    elif (kind is not tuple and kind is not list) or len(value) > _PLAIN_ITEMS:
        return False
    for item in value:
        kind = type(item)
        if kind in _PLAIN_TYPES or ((kind is tuple or kind is dict) and not item):
            continue  # (an empty call's args and kwargs, without a call each)
        if not _plain(item, depth + 1):
            return False
    return True


def dumps(value: Any) -> tuple[bytes, list[memoryview]]:
    """Serialise ``value``; returns the pickle payload and the out-of-band buffers."""
    try:
        payload, buffers = _Reusable.of_this_thread(_local).dump(value)
    except AsyncRPCError:
        raise  # a reducer's own error (an RRef that cannot travel, say) says it best
    except Exception as exc:
        raise SerializationError(f"cannot serialize {_describe(value)}: {exc}") from exc
    return payload, buffers


def loads(payload: bytes | bytearray, buffers: Sequence[Any] = ()) -> Any:
    """Rebuild a value from its payload and the received buffer objects."""
    try:
        return pickle.loads(payload, buffers=buffers)
    except SerializationError:
        raise
    except (AttributeError, ImportError) as exc:  # a function or class not defined here
        raise SerializationError(f"cannot deserialize payload: {exc!r}; {BY_REFERENCE}") from exc
    except Exception as exc:
        raise SerializationError(f"cannot deserialize payload: {exc!r}") from exc


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def _describe(value: Any) -> str:
    """A short repr for an error message: bounded in depth and length (a 100k-deep
    argument's full repr would itself raise RecursionError), never failing."""
    try:
        text = _SHORT.repr(value)
    except Exception:
        text = f"<{type(value).__qualname__} object>"
    return text if len(text) <= 120 else text[:117] + "..."
