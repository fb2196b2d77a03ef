"""Values whose only parts beyond pickle's own are CPU tensors and arrays, without reducers.

Theory of operation
-------------------
Most calls and replies of a training job carry a few tensors beside plain values: a
batch and a step number, a gradient, an observation.  Through ``dumps`` each tensor
costs the reducer hook (called for every object of the value), a reduction naming its
rebuild function (found through the import machinery at both ends), a
``PickleBuffer`` and the buffer callback; in a worker, where a message's code runs
with cold caches, a small tensor's request took ~18 µs to pickle where the same call
of scalars takes ~2.

Here the C pickler asks :meth:`_LeanPickler.persistent_id` about each object instead.
A plain CPU tensor or numpy array becomes a small int in the payload; its *entry*
(kind, dtype, shape, strides) goes to the frame's header, and its bytes out of band as
ever (the same zero-copy view, so large ones still take shared memory).  Everything
else pickles as pickle pickles it.  The receiver builds the tensors from the entries
and buffers first, and its unpickler's ``persistent_load`` is the list's
``__getitem__``.  A tensor met twice is one entry, so it arrives as one object, as
pickle's memo would have it.  A value that is one tensor or array, the commonest reply,
skips the pickler at both ends: its payload is the constant ``_FIRST``.

:func:`dumps_lean` gives up (None) on a value whose entries would not fit in a frame's
header (more than ``ENTRIES_MAX`` tensors and arrays, or more than ``ENTRIES_ROOM`` bytes
of entries), and on anything a reducer must see: a registered type
(an RRef, a Parameter), a tensor of another kind (CUDA, sparse, quantized, a subclass),
and a tensor that requires grad (distributed autograd records those as they are
pickled; a plain tensor's ``requires_grad`` travels in ``dumps``' meta).  The message
then takes ``dumps``.  A look at the value's top two levels comes first, as most such
values show it there, so the pickler seldom does work it then throws away.
"""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any, Final

import msgpack
import numpy as np
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.serde.arrays import load_ndarray
from asyncrpc.serde.pickler import _PLAIN_TYPES, _REDUCERS, ReusablePickler
from asyncrpc.serde.tensors import (
    _DTYPE_NAMES,
    _NUMPY_DTYPES,
    TensorMeta,
    dump_array,
    dump_tensor,
    load_tensor,
    strided_array,
)
from asyncrpc.wire.codec import MAX_HEADER_SIZE

Entry = tuple[str, str, tuple[int, ...], tuple[int, ...]]
"""(``"t"`` for a tensor or ``"a"`` for an array, dtype name, shape, strides)"""

_CONTAINERS = frozenset({tuple, list, dict})
ENTRIES_MAX: Final = 2048
"""Tensors and arrays a lean message carries, at most: their entries go to its frame's
header, which holds 64 KiB, and an entry takes 20 to 40 bytes for the tensors of a
model (its state dict, its gradients), more for many dimensions.  A value with more,
or whose entries would take more than ``ENTRIES_ROOM`` (``_fit``), takes ``dumps``,
whose payload carries their metadata."""
ENTRIES_ROOM: Final = MAX_HEADER_SIZE - 8 * 1024
"""Bytes of a frame's header the entries and buffer descriptors may take (the rest is
for the message's other header fields: its function's name, what it carries)."""
_ENTRY_BYTES: Final = 10 + max(len(name) for name in _DTYPE_NAMES.values())
_DIMENSION_BYTES: Final = 18
"""An entry takes at most ``_ENTRY_BYTES`` (the array, the kind, the dtype's name, the
two lists' headers) plus this for each dimension (a size and a stride of 9 bytes each):
``_fit`` packs entries to count them only where that bound fails."""
_local = threading.local()


class _GiveUpError(Exception):
    """A reducer must see this value: ``dumps`` it is."""


class _LeanPickler(pickle.Pickler):
    def __init__(self, stream: io.BytesIO) -> None:
        super().__init__(stream, protocol=5)
        self.entries: list[Entry] = []
        self.buffers: list[memoryview] = []
        self.seen: dict[int, int] = {}  # id of a tensor or array -> its persistent id
        self.kept: list[Any] = []  # what ``seen`` names stays alive until the reset
        self.widest = 0  # the most dimensions an entry has (see _fit)

    def persistent_id(self, obj: Any) -> int | None:  # called for every object
        kind = type(obj)
        if kind in _PLAIN_TYPES or kind in _CONTAINERS:
            return None
        if kind is torch.Tensor:
            return self._out_of_band(obj, "t")
        if kind is np.ndarray:
            return self._out_of_band(obj, "a")
        if kind in _REDUCERS or isinstance(obj, torch.Tensor):
            raise _GiveUpError
        return None

    def _out_of_band(self, value: Any, kind: str) -> int:
        known = self.seen.get(id(value))
        if known is not None:
            return known
        if len(self.entries) == ENTRIES_MAX:  # the header would grow too long (see _fit)
            raise _GiveUpError
        entry, view = _split(value, kind)
        index = self.seen[id(value)] = len(self.entries)
        self.kept.append(value)
        self.entries.append(entry)
        self.buffers.append(view)
        self.widest = max(self.widest, len(entry[2]))
        return index

    def reset(self) -> None:
        self.clear_memo()
        self.entries, self.buffers, self.seen, self.kept = [], [], {}, []
        self.widest = 0


def _split(value: Any, kind: str) -> tuple[Entry, memoryview]:
    """A tensor's (``kind`` "t") or an array's ("a") entry and bytes."""
    if kind == "t":
        dumped = None if value.requires_grad else dump_tensor(value)
    else:
        dumped = dump_array(value)
    if dumped is None:
        raise _GiveUpError
    meta, view = dumped
    return (kind, meta[0], meta[1], meta[2]), view


_FIRST: Final = pickle.PROTO + b"\x05" + pickle.BININT1 + b"\x00" + pickle.BINPERSID + pickle.STOP
"""The payload of a value that is one tensor or array, the commonest reply: it skips the
pickler at both ends."""
_KINDS: Final = {torch.Tensor: "t", np.ndarray: "a"}


class _Reusable(ReusablePickler):
    """The lean pickler of a thread (see ``ReusablePickler``), reset after each dump."""

    def __init__(self) -> None:
        super().__init__()
        self.pickler = _LeanPickler(self.stream)

    def dump(self, value: Any) -> tuple[bytes, list[Entry], list[memoryview]] | None:
        pickler = self.pickler
        self.busy = True
        try:
            pickler.dump(value)
            if not _fit(pickler.entries, pickler.widest):
                return None
            return self.stream.getvalue(), pickler.entries, pickler.buffers
        except Exception:  # _GiveUpError, or what ``dumps`` will say better (a lambda, say)
            return None
        finally:
            pickler.reset()
            self.rewind()


def _fit(entries: list[Entry], widest: int) -> bool:
    """Whether ``entries`` (of ``widest`` dimensions at most) and their buffers'
    descriptors (9 bytes each at most, one a buffer) fit in a frame's header with room
    to spare (``ENTRIES_ROOM``): by their bound where it is enough (a state dict's of
    up to ~600 tensors), else packed and counted (~0.3 µs an entry)."""
    descriptors = 9 * len(entries)
    if len(entries) * (_ENTRY_BYTES + _DIMENSION_BYTES * widest) + descriptors <= ENTRIES_ROOM:
        return True
    return len(msgpack.packb(entries)) + descriptors <= ENTRIES_ROOM


def dumps_lean(value: Any) -> tuple[bytes, list[Entry], list[memoryview]] | None:
    """``value`` as (payload, entries for the header, out-of-band buffers), if its only
    parts beyond pickle's own are plain CPU tensors and arrays; None if a reducer must
    see some part of it (see the module docstring), or pickle cannot take it (``dumps``
    then says why)."""
    kind = _KINDS.get(type(value))
    if kind is not None:
        try:
            entry, view = _split(value, kind)
        except _GiveUpError:
            return None
        return _FIRST, [entry], [view]
    if _for_a_reducer(value, 0):
        return None
    return _Reusable.of_this_thread(_local).dump(value)


def _for_a_reducer(value: Any, depth: int) -> bool:
    """Whether the top levels of ``value`` show a part a reducer must see (an RRef's
    method call, a tensor that requires grad), which would make the lean pickler give up
    after work done in vain: a cheap look first, as most such values show it there."""
    kind = type(value)
    if kind is torch.Tensor:
        return bool(value.requires_grad)
    if kind in _REDUCERS:
        return kind is not np.ndarray
    if depth < _LOOK_DEPTH and (kind is tuple or kind is list):
        for item in value:  # (a loop costs less than any()'s generator)
            if _for_a_reducer(item, depth + 1):
                return True
    return False


_LOOK_DEPTH: Final = 2


def loads_lean(payload: bytes | bytearray, entries: Any, buffers: Any) -> Any:
    """Rebuild a value from :func:`dumps_lean`'s payload, the entries its header
    carried and the buffer objects received for them."""
    try:
        if not isinstance(entries, list) or len(entries) != len(buffers):
            raise ValueError(f"{len(buffers)} buffers for tensor entries {entries!r:.80}")
        values = [_rebuilt(entry, buffer) for entry, buffer in zip(entries, buffers, strict=True)]
        if payload == _FIRST and values:
            return values[0]
        unpickler = pickle.Unpickler(io.BytesIO(payload))
        unpickler.persistent_load = values.__getitem__  # type: ignore[method-assign]
        return unpickler.load()
    except SerializationError:
        raise
    except Exception as exc:
        raise SerializationError(f"cannot deserialize payload: {exc!r}") from exc


def _rebuilt(entry: Any, buffer: Any) -> Any:
    kind, dtype, shape, strides = entry
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is not None and type(buffer) is np.ndarray and 0 not in shape:
        # Memory this process received into (a small buffer's own allocation): the array
        # and the tensor over it are made here directly (2.2 -> 1.8 µs a tensor, hot).
        array = strided_array(buffer, np_dtype, shape, strides)
        return array if kind == "a" else torch.from_numpy(array)
    meta: TensorMeta = (dtype, tuple(shape), tuple(strides), False, "cpu", False)
    if kind == "a":
        return load_ndarray(meta, buffer)
    if kind == "t":
        return load_tensor(meta, buffer)
    raise ValueError(f"unknown kind of out-of-band value {kind!r}")
