"""numpy arrays travel as tensors do: their bytes out of band, zero-copy.

Theory of operation
-------------------
numpy pickles an array (protocol 5) as a ``PickleBuffer`` of its memory, which
the receiving side must be able to read as bytes.  Ours receives buffers as
fresh memory or shared-memory mappings, so instead an array of a dtype torch
shares memory with travels as the tensor ``torch.from_numpy`` would make of it
does: meta and a zero-copy view of its bytes, split by numpy alone
(``tensors.dump_array``: a call into torch releases the GIL), or through
``torch.from_numpy`` for strides numpy allows and tensors do not (negative ones).
It is rebuilt on arrival as the array over the received memory (by numpy alone
where it has the dtype, no copy either).  Any other array (object, string,
date, long double, non-native byte order dtypes) keeps numpy's own reduction;
its buffer then travels inside the pickle stream (see
:mod:`asyncrpc.serde.pickler`).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from asyncrpc.serde.tensors import TensorMeta, dump_array, load_tensor, numpy_view


def reduce_ndarray(array: np.ndarray[Any, Any], reduce_tensor: Any, out_of_band: Any) -> Any:
    """``(load_ndarray, args)`` for an array torch can view, else ``NotImplemented``:
    by numpy alone where it can (``dump_array``), else through ``torch.from_numpy``."""
    dumped = dump_array(array)
    if dumped is not None:
        meta, view = dumped
        return load_ndarray, (meta, out_of_band(view))
    try:
        tensor = _as_tensor(array)
    except (TypeError, ValueError):  # a dtype or byte order torch does not share
        return NotImplemented
    reduced = reduce_tensor(tensor)
    if reduced is NotImplemented:
        return NotImplemented
    return load_ndarray, reduced[1]


def _as_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor:
    if any(stride < 0 for stride in array.strides):  # reversed views: torch has none
        array = np.ascontiguousarray(array)
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():  # read-only: we only read it, and the receiver's
        warnings.simplefilter("ignore")  # copy is its own, writable
        return torch.from_numpy(array)


def load_ndarray(meta: TensorMeta, buffer: Any) -> np.ndarray[Any, Any]:
    """Rebuild an array over the buffer its bytes were received into (by numpy alone
    where it can: no call into torch)."""
    array = numpy_view(meta, buffer)
    return load_tensor(meta, buffer).numpy() if array is None else array
