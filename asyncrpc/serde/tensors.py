"""Tensors as (meta, raw bytes): what travels, and how it is rebuilt.

Theory of operation
-------------------
A tensor's *span* is the storage range its elements touch.  The span is sent as
is and the strides are kept (a transposed matrix arrives transposed, a sliced
view arrives as a view with the same strides, as torch's RPC keeps them) unless
that would waste much: a view with gaps whose span is at least 8 KiB and at
least twice its elements (torch's rule for recopying) is made contiguous first,
so a 10-element view of a 1 GB storage sends 10 elements.

The bytes are exposed as a byte memoryview over the tensor's memory, without
copying: the memoryview's exporter (a ctypes array) holds a reference to the
tensor, so the memory stays alive for as long as a transport still holds the
view.  On the receiving side the bytes are already in fresh storage (a uint8
tensor, or a shared-memory mapping), and the tensor is a typed, strided view of
it.  CUDA tensors are staged through host memory once every stream of their
device has finished, and land on the same device index on the receiver.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Final

import numpy as np
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.serde import cuda
from asyncrpc.serde.devices import CudaRoute

TensorMeta = tuple[str, tuple[int, ...], tuple[int, ...], bool, str, bool]
"""(dtype name, shape, strides, requires_grad, device, is_parameter)"""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {d: name for name, d in _DTYPES.items()}


def _numpy_dtypes() -> dict[str, np.dtype[Any]]:
    """Our dtype names that numpy has, each with the numpy dtype ``torch.from_numpy``
    makes a tensor of that dtype of."""
    found = {}
    for name, torch_dtype in _DTYPES.items():
        try:
            dtype = np.dtype(name)
        except TypeError:  # bfloat16, float8_*, qint8, ...: numpy has none
            continue
        if torch.from_numpy(np.empty(0, dtype)).dtype == torch_dtype:
            found[name] = dtype
    return found


_NUMPY_DTYPES: Final = _numpy_dtypes()
_NUMPY_NAMES: Final = {dtype: name for name, dtype in _NUMPY_DTYPES.items()}


def _lazy_bits() -> int | None:
    """The dispatch keys of a tensor's lazy conjugate and negative bits, as a mask of
    ``DispatchKeySet.raw_repr()`` (None where this torch does not expose them)."""
    try:
        keys, key = torch._C.DispatchKeySet, torch._C.DispatchKey
        return int(keys(key.Conjugate).raw_repr() | keys(key.Negative).raw_repr())
    except (AttributeError, TypeError):
        return None


_LAZY_BITS = _lazy_bits()


def byte_view(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """A writable byte memoryview of ``nbytes`` at ``tensor.data_ptr()`` that keeps it alive."""
    return _view_at(tensor.data_ptr(), nbytes, tensor)


def _view_at(address: int, nbytes: int, owner: object) -> memoryview:
    """A writable byte memoryview of ``nbytes`` at ``address`` that keeps ``owner`` alive."""
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(address)
    array._keepalive = owner  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Number of storage elements between the first and last element, inclusive."""
    if 0 in shape:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


_RECOPY_FROM = 8 * 1024  # bytes: a smaller span is sent whole, gaps and all (torch's bound)


def _wasteful(span: int, numel: int, itemsize: int) -> bool:
    """Whether sending a view's span would waste much: at least 8 KiB, and at least
    twice its own elements (torch's rule for when a view is recopied)."""
    return span * itemsize >= _RECOPY_FROM and span >= 2 * numel


def dump_tensor(tensor: torch.Tensor) -> tuple[TensorMeta, memoryview] | None:
    """Split a tensor into header meta and a zero-copy view of its bytes; None for a
    tensor we do not serialise ourselves (not strided, quantized, or on a meta device).

    Written for few calls into torch: each costs a microsecond or more once the caches
    have gone cold between messages, and a small tensor's dump is made of little else.
    """
    if not tensor.is_cpu or tensor.layout is not torch.strided or tensor.is_quantized:
        return None
    data = _resolved(tensor)
    shape, stride = tuple(data.shape), data.stride()
    dtype = data.dtype
    span = numel = math.prod(shape)
    if not data.is_contiguous():  # (a contiguous tensor spans its elements exactly)
        span = _span(shape, stride)
        if span > numel and _wasteful(span, numel, dtype.itemsize):  # its elements only
            data = data.detach().contiguous()
            stride = data.stride()
            span = numel
    return _meta(tensor, dtype, shape, stride, "cpu"), byte_view(data, span * dtype.itemsize)


def dump_array(array: np.ndarray[Any, Any]) -> tuple[TensorMeta, memoryview] | None:
    """``dump_tensor`` of the tensor ``torch.from_numpy(array)`` would make, by numpy
    alone (no call into torch); None for a dtype torch does not share, or strides that
    are negative or not whole elements."""
    name = _NUMPY_NAMES.get(array.dtype)
    itemsize = array.itemsize
    if name is None or any(step < 0 or step % itemsize for step in array.strides):
        return None
    stride = tuple(step // itemsize for step in array.strides)
    span, numel = _span(array.shape, stride), array.size
    if span > numel and _wasteful(span, numel, itemsize):  # send its elements only
        array = np.ascontiguousarray(array)
        stride, span = tuple(step // itemsize for step in array.strides), numel
    meta = (name, array.shape, stride, False, "cpu", False)
    return meta, _view_at(array.__array_interface__["data"][0], span * itemsize, array)


def _resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy with its lazy conjugate and negative bits applied (they are
    not in its bytes).  Read from its dispatch keys: ``is_conj()`` and ``is_neg()``
    release the GIL."""
    if _LAZY_BITS is None:
        lazy = tensor.is_conj() or tensor.is_neg()
    else:
        lazy = bool(torch._C._dispatch_keys(tensor).raw_repr() & _LAZY_BITS)
    if lazy:
        return tensor.detach().resolve_conj().resolve_neg()
    return tensor


def _meta(
    tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], stride: Any, device: str
) -> TensorMeta:
    return (
        _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch."),
        shape,
        tuple(stride),
        tensor.requires_grad,
        device,
        # (a plain tensor is no Parameter: spare it Parameter's Python __instancecheck__)
        type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter),
    )


def dump_cuda_tensor(
    tensor: torch.Tensor, route: CudaRoute | None, staged: list[Any] | None
) -> tuple[TensorMeta, str, Any] | None:
    """A CUDA tensor as (meta, path, what travels): ``"ipc"`` and torch's IPC handle, or
    ``"bytes"`` and a pinned host copy (being made: see :mod:`asyncrpc.serde.cuda`);
    None for a layout we do not serialise ourselves.  ``route`` (None: the value stays
    in this process) says which device it lands on; SerializationError if none."""
    if tensor.layout is not torch.strided or tensor.is_quantized:
        return None
    source = str(tensor.device)
    target = route.target(source) if route is not None else source
    data = _resolved(tensor).detach()
    if not data.is_contiguous():
        data = data.contiguous()
    path, value = cuda.dump_cuda(data, route, staged)
    return _meta(tensor, data.dtype, tuple(data.shape), data.stride(), target), path, value


def load_tensor(meta: TensorMeta, buffer: Any) -> torch.Tensor:
    """Rebuild a tensor from its meta and the buffer its bytes were received into."""
    dtype_name, shape, stride, requires_grad, device, is_parameter = meta
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise SerializationError(f"unknown tensor dtype {dtype_name!r}")
    array = numpy_view(meta, buffer)
    if array is not None:  # one call into torch (each releases the GIL)
        return _with_grad(torch.from_numpy(array), requires_grad, is_parameter)
    raw = _as_uint8(buffer)
    if device != "cpu" and raw.device.type == "cpu":
        raw = cuda.upload(raw, device) if raw.numel() else raw.to(cuda.device_of(device))
    if 0 in shape:  # no elements: nothing was sent
        tensor = torch.empty_strided(shape, stride, dtype=dtype, device=raw.device)
    else:
        tensor = raw.view(dtype).as_strided(shape, stride)
    return _with_grad(tensor, requires_grad, is_parameter)


def _with_grad(tensor: torch.Tensor, requires_grad: bool, is_parameter: bool) -> torch.Tensor:
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def numpy_view(meta: TensorMeta, buffer: Any) -> np.ndarray[Any, Any] | None:
    """The array ``meta`` describes over ``buffer``, built by numpy alone (it keeps the
    GIL); None for a buffer that is a tensor or read-only, a dtype numpy does not have,
    or a tensor that is not for this process's memory or has no elements."""
    dtype_name, shape, stride, _, device, _ = meta
    dtype = _NUMPY_DTYPES.get(dtype_name)
    if dtype is None or device != "cpu" or 0 in shape or isinstance(buffer, torch.Tensor):
        return None
    array = buffer if type(buffer) is np.ndarray else np.frombuffer(buffer, np.uint8)
    if not array.flags.writeable:
        return None
    return strided_array(array, dtype, shape, stride)


def strided_array(
    buffer: np.ndarray[Any, Any], dtype: np.dtype[Any], shape: Any, stride: Any
) -> np.ndarray[Any, Any]:
    """The array of ``dtype``, ``shape`` and ``stride`` (in elements) over ``buffer``, a
    writable byte array, from its start (numpy checks that it fits)."""
    itemsize = dtype.itemsize
    return np.ndarray(shape, dtype, buffer, 0, [step * itemsize for step in stride])


def _as_uint8(buffer: Any) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        return buffer
    if len(memoryview(buffer)) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def load_ipc_tensor(meta: TensorMeta, shared: cuda.Shared) -> torch.Tensor:
    """Rebuild a tensor a peer shared by CUDA IPC (copied to its own memory here)."""
    return load_tensor(meta, cuda.load_shared(shared, meta[4]))


def allocate_tensor_storage(nbytes: int) -> tuple[np.ndarray[Any, Any], memoryview]:
    """Wire allocator: fresh host memory (a numpy byte array: ``torch.empty`` would
    release the GIL), and a byte view the kernel can fill."""
    storage = np.empty(nbytes, np.uint8)
    return storage, memoryview(storage.data)
