"""Unit tests for serde: pickle protocol 5 with tensor storages out of band."""

from __future__ import annotations

import gc
import operator
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.serde import (
    allocate_tensor_storage,
    dumps,
    dumps_plain,
    loads,
    pickler,
    register_plain,
    register_reducer,
)


def receive(buffers: list[memoryview]) -> list[torch.Tensor]:
    """What the transport does: fresh uint8 storage per buffer, the bytes copied in."""
    received = []
    for buf in buffers:
        storage, view = allocate_tensor_storage(len(buf))
        assert len(view) == len(buf)
        view[:] = buf
        received.append(storage)
    return received


def round_trip(value: Any) -> Any:
    payload, buffers = dumps(value)
    assert isinstance(payload, bytes)
    for buf in buffers:
        assert isinstance(buf, memoryview)
        assert buf.format == "B" and buf.ndim == 1 and buf.contiguous
    return loads(payload, receive(buffers))


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as bytes, in logical (row-major) order."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def assert_same_tensor(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.device == want.device
    assert got.requires_grad == want.requires_grad
    assert raw_bytes(got) == raw_bytes(want)


def _creatable_dtypes() -> list[torch.dtype]:
    found = set()
    for value in vars(torch).values():
        if not isinstance(value, torch.dtype):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.ones(2, dtype=value)
        except Exception:
            continue
        if t.is_quantized or t.layout is not torch.strided:
            continue
        found.add(value)
    return sorted(found, key=str)


DTYPES = _creatable_dtypes()
REQUIRED_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool,
}  # fmt: skip


def test_every_common_dtype_is_covered() -> None:
    assert set(DTYPES) >= REQUIRED_DTYPES


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make", [torch.zeros, torch.ones], ids=["zeros", "ones"])
def test_dtype_round_trip(dtype: torch.dtype, make: Any) -> None:
    t = make(3, 5, dtype=dtype)
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [t.numel() * t.element_size()]
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.stride() == t.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex128])
def test_random_values_round_trip(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    if dtype is torch.bool:
        t = torch.randint(0, 2, (7, 11), generator=gen).bool()
    elif dtype.is_complex or dtype.is_floating_point:
        t = torch.randn(7, 11, dtype=dtype, generator=gen)
    else:
        t = torch.randint(-(2**40), 2**40, (7, 11), generator=gen, dtype=dtype)
    assert_same_tensor(round_trip(t), t)


def test_special_float_values_round_trip() -> None:
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 5e-324], dtype=torch.float64)
    assert raw_bytes(round_trip(t)) == raw_bytes(t)


def test_zero_dim_tensor() -> None:
    t = torch.tensor(3.5, dtype=torch.float64)
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [8]
    got = loads(payload, receive(buffers))
    assert got.dim() == 0
    assert got.item() == 3.5
    assert_same_tensor(got, t)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 4)])
def test_empty_tensor(shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=torch.float32)
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [0]
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.shape == shape


def test_transpose_keeps_strides() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = x.t()
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [12 * 4]  # dense: sent as is
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.stride() == t.stride() == (1, 4)
    assert not got.is_contiguous()


def test_permuted_3d_keeps_strides() -> None:
    t = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4).permute(2, 0, 1)
    got = round_trip(t)
    assert_same_tensor(got, t)
    assert got.stride() == t.stride()


def test_small_view_with_gaps_keeps_its_strides() -> None:
    """As in torch: a view spanning under 8 KiB travels with its gaps (no copy)."""
    x = torch.rand(5, 5)
    t = x.narrow(1, 2, 2)
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [(1 + 4 * 5 + 1) * 4]  # its span, from (0, 2)
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.stride() == t.stride() == (5, 1) and not got.is_contiguous()


def test_large_view_mostly_gaps_becomes_contiguous_and_sends_only_its_elements() -> None:
    x = torch.arange(4000, dtype=torch.float64).reshape(40, 100)
    t = x[:, ::3]  # span 4 k elements (32 KB) for 1.4 k
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [t.numel() * t.element_size()]
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.is_contiguous()


def test_large_view_with_few_gaps_keeps_its_strides() -> None:
    x = torch.arange(4000, dtype=torch.float64).reshape(40, 100)
    t = x[:, 1:]  # span under twice its elements: sent whole, strides kept
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [(1 + 39 * 100 + 98) * 8]
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.stride() == (100, 1)


def test_offset_view_of_a_large_tensor_sends_only_its_bytes() -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    t = big[10:20]
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [40]
    assert len(payload) < 1000
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.tolist() == list(range(10, 20))
    assert got.untyped_storage().nbytes() == 40  # the receiver holds just those bytes


def test_column_of_a_large_matrix_sends_only_its_elements() -> None:
    big = torch.arange(1000 * 1000, dtype=torch.float32).reshape(1000, 1000)
    t = big[:, 7]
    _, buffers = dumps(t)
    assert sum(len(b) for b in buffers) == 1000 * 4
    assert_same_tensor(round_trip(t), t)


def test_expanded_tensor_sends_only_the_underlying_elements() -> None:
    t = torch.arange(3, dtype=torch.float32).expand(1000, 3)
    payload, buffers = dumps(t)
    assert [len(b) for b in buffers] == [3 * 4]
    got = loads(payload, receive(buffers))
    assert_same_tensor(got, t)
    assert got.stride() == (0, 1)


def test_scalar_expanded() -> None:
    t = torch.tensor(2.0).expand(4, 5)
    _, buffers = dumps(t)
    assert [len(b) for b in buffers] == [4]
    assert_same_tensor(round_trip(t), t)


def test_requires_grad_preserved() -> None:
    leaf = torch.ones(4, requires_grad=True)
    non_leaf = leaf * 2
    plain = torch.ones(4)
    got_leaf, got_non_leaf, got_plain = round_trip([leaf, non_leaf, plain])
    assert got_leaf.requires_grad and got_leaf.is_leaf
    assert got_non_leaf.requires_grad and got_non_leaf.is_leaf  # the graph does not travel
    assert not got_plain.requires_grad
    assert raw_bytes(got_non_leaf) == raw_bytes(non_leaf)
    got_leaf.sum().backward()  # usable as a leaf
    assert got_leaf.grad is not None


@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_stays_parameter(requires_grad: bool) -> None:
    p = torch.nn.Parameter(torch.randn(3, 2), requires_grad=requires_grad)
    got = round_trip(p)
    assert type(got) is torch.nn.Parameter
    assert got.requires_grad is requires_grad
    assert raw_bytes(got) == raw_bytes(p)


def test_module_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    state = module.state_dict()
    got = round_trip(state)
    assert list(got) == list(state)
    for key in state:
        assert_same_tensor(got[key], state[key])


def test_nested_containers_with_several_tensors() -> None:
    a = torch.arange(5, dtype=torch.int64)
    b = torch.randn(2, 3)
    c = torch.tensor([True, False])
    value = {
        "list": [a, 1, "two", (b, None)],
        "tuple": (3.5, {"inner": c}),
        "set": frozenset({1, 2}),
        "bytes": b"raw",
    }
    payload, buffers = dumps(value)
    assert len(buffers) == 3
    got = loads(payload, receive(buffers))
    assert got["list"][1:3] == [1, "two"]
    assert got["list"][3][1] is None
    assert got["tuple"][0] == 3.5
    assert got["set"] == frozenset({1, 2})
    assert got["bytes"] == b"raw"
    assert_same_tensor(got["list"][0], a)
    assert_same_tensor(got["list"][3][0], b)
    assert_same_tensor(got["tuple"][1]["inner"], c)


def test_same_tensor_twice_is_sent_once_and_stays_shared() -> None:
    t = torch.randn(100)
    payload, buffers = dumps([t, {"again": t}, (t,)])
    assert len(buffers) == 1
    got = loads(payload, receive(buffers))
    assert got[0] is got[1]["again"] is got[2][0]
    assert_same_tensor(got[0], t)


def test_rpc_request_tuple_round_trip() -> None:
    args = (torch.ones(2, 2), torch.full((3,), 7.0))
    payload, buffers = dumps((torch.add, args, {"alpha": 2}))
    func, got_args, kwargs = loads(payload, receive(buffers))
    assert func is torch.add
    assert kwargs == {"alpha": 2}
    assert torch.equal(func(got_args[0], got_args[0], **kwargs), torch.full((2, 2), 3.0))


@pytest.mark.parametrize("func", [torch.add, torch.matmul, operator.add, len, torch.nn.Linear])
def test_functions_and_classes_travel_by_reference(func: Any) -> None:
    payload, buffers = dumps(func)
    assert buffers == []
    assert len(payload) < 200
    assert loads(payload, []) is func


def test_lambda_raises_serialization_error() -> None:
    with pytest.raises(SerializationError, match=r"cannot serialize .*lambda") as info:
        dumps(lambda x: x + 1)
    assert isinstance(info.value, TypeError)  # the builtin mix-in callers expect


def test_local_function_raises_serialization_error() -> None:
    def local_step(x: int) -> int:
        return x

    with pytest.raises(SerializationError, match=r"cannot serialize .*local_step"):
        dumps({"fn": local_step, "tensor": torch.ones(1)})


def test_serialization_error_message_is_bounded() -> None:
    value = [lambda: None, "x" * 1000]
    with pytest.raises(SerializationError) as info:
        dumps(value)
    assert len(str(info.value)) < 1000


@pytest.mark.parametrize(
    "payload",
    [b"", b"garbage bytes", b"\x80\x05\x95", b"\x80\x05N", pickle.dumps([1, 2])[:-3]],
    ids=["empty", "garbage", "truncated-frame", "no-stop", "truncated-list"],
)
def test_loads_garbage_raises_serialization_error(payload: bytes) -> None:
    with pytest.raises(SerializationError, match="cannot deserialize"):
        loads(payload, [])


def only_on_the_sender() -> None:
    """Pickled by reference; removed from this module before unpickling."""


def test_loads_of_a_function_missing_here_says_code_is_not_sent() -> None:
    payload, buffers = dumps(only_on_the_sender)
    del globals()["only_on_the_sender"]  # as on a callee that lacks it
    try:
        with pytest.raises(SerializationError) as info:
            loads(payload, buffers)
    finally:
        globals()["only_on_the_sender"] = _keep
    message = str(info.value)
    assert "only_on_the_sender" in message
    assert "does not serialize function code" in message
    assert "define them on both caller and callee" in message


_keep = only_on_the_sender


def test_loads_missing_buffers_raises_serialization_error() -> None:
    payload, buffers = dumps(torch.ones(3))
    assert len(buffers) == 1
    with pytest.raises(SerializationError):
        loads(payload, [])


def test_loads_too_short_buffer_raises_serialization_error() -> None:
    payload, _ = dumps(torch.ones(10, dtype=torch.float64))
    storage, _ = allocate_tensor_storage(8)
    with pytest.raises(SerializationError):
        loads(payload, [storage])


def test_loads_accepts_plain_byte_buffers() -> None:
    """The default codec allocator hands out bytearrays; those work as buffers too."""
    t = torch.randn(4, 4, dtype=torch.float64)
    payload, buffers = dumps(t)
    got = loads(payload, [bytearray(b) for b in buffers])
    assert_same_tensor(got, t)


def test_dumps_is_zero_copy_for_dense_tensors() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    _, (buf,) = dumps(t)
    assert torch.frombuffer(buf, dtype=torch.uint8).data_ptr() == t.data_ptr()
    offset = torch.arange(100, dtype=torch.int32)[10:20]
    _, (buf,) = dumps(offset)
    assert torch.frombuffer(buf, dtype=torch.uint8).data_ptr() == offset.data_ptr()


def _churn_allocator() -> None:
    # Allocate and fill memory of similar sizes, so that freed storage would be overwritten.
    # (Sizes stay below malloc's mmap threshold, so freed blocks get reused, not unmapped.)
    for _ in range(3):
        junk = [torch.full((8_000,), -1.0) for _ in range(50)]
        del junk


def test_buffer_keeps_the_tensor_alive() -> None:
    t = torch.arange(8_000, dtype=torch.float32)
    expected = raw_bytes(t)
    payload, buffers = dumps(t)
    del t
    gc.collect()
    _churn_allocator()
    assert bytes(buffers[0]) == expected
    assert_same_tensor(loads(payload, receive(buffers)), torch.arange(8_000, dtype=torch.float32))


def test_buffer_keeps_a_contiguous_copy_alive() -> None:
    """A gapped view is copied to a temporary: the buffer alone must keep that copy alive."""
    x = torch.arange(16_000, dtype=torch.float32).reshape(80, 200)
    t = x[:, ::4]
    expected = raw_bytes(t)
    _, buffers = dumps(t)
    del x, t
    gc.collect()
    _churn_allocator()
    assert bytes(buffers[0]) == expected


def test_received_tensor_owns_its_storage() -> None:
    t = torch.randn(10)
    payload, buffers = dumps(t)
    storages = receive(buffers)
    got = loads(payload, storages)
    del storages
    gc.collect()
    _churn_allocator()
    assert raw_bytes(got) == raw_bytes(t)
    got.add_(1)  # writable
    assert not torch.equal(got, t)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(),
        lambda: torch.tensor([[1 + 1j, 2 + 2j], [3 + 3j, 4 + 4j]]).mH,
    ],
    ids=["conj", "mH"],
)
def test_conjugate_view_round_trip(make: Any) -> None:
    t = make()
    assert t.is_conj()
    got = round_trip(t)
    assert torch.equal(got, t)


def test_negative_view_round_trip() -> None:
    t = torch._neg_view(torch.tensor([1.0, 2.0, -3.0]))
    assert t.is_neg()
    got = round_trip(t)
    assert torch.equal(got, t)


def test_lazy_bits_of_a_detached_tensor_are_applied() -> None:
    """``detach()`` keeps a negative bit but makes no view: the bits are read from the
    dispatch keys, not from whether the tensor is a view."""
    t = torch.tensor([1 + 2j, 3 - 4j]).conj().imag.detach()
    assert t.is_neg() and not t._is_view()
    got = round_trip(t)
    assert not got.is_neg()
    assert got.tolist() == [-2.0, 4.0]


def test_a_small_tensor_crosses_with_one_call_into_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call into torch that makes a tensor, and ``is_conj``/``is_neg``, releases the
    GIL (docs/architecture.md): a CPU tensor of a dtype numpy has is sent with none and
    received with one ``torch.from_numpy``."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    made: list[Any] = []
    from_numpy = torch.from_numpy

    def counted(array: Any) -> torch.Tensor:
        made.append(array)
        return from_numpy(array)

    def no_torch(*_: Any, **__: Any) -> Any:
        raise AssertionError("called torch")

    for name in ("empty", "frombuffer", "empty_strided"):
        monkeypatch.setattr(torch, name, no_torch)
    for name in ("is_conj", "is_neg", "view", "as_strided"):
        monkeypatch.setattr(torch.Tensor, name, no_torch)
    monkeypatch.setattr(torch, "from_numpy", counted)
    payload, buffers = dumps(t)
    got = loads(payload, receive(buffers))
    monkeypatch.undo()
    assert len(made) == 1
    assert_same_tensor(got, t)
    assert got.stride() == t.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bfloat16], ids=str)
def test_received_tensor_is_writable_and_owns_its_bytes(dtype: torch.dtype) -> None:
    """numpy builds the tensor where it has the dtype (one call into torch, which
    releases the GIL), torch where it has not (bfloat16); either way the receiver may
    write to what it got without touching the sender's tensor, but not grow it."""
    t = torch.arange(12, dtype=dtype).reshape(3, 4).t()
    payload, buffers = dumps(t)
    received = receive(buffers)
    got = loads(payload, received)
    assert_same_tensor(got, t)
    assert got.stride() == t.stride()
    got.add_(1)
    assert torch.equal(got, t + 1)
    assert torch.equal(t, torch.arange(12, dtype=dtype).reshape(3, 4).t())
    with pytest.raises(RuntimeError, match="not resizable"):  # (docs/coming_from_torch_rpc.md)
        got.resize_(100)


def _sparse_forms() -> dict[str, torch.Tensor]:
    dense = torch.arange(24, dtype=torch.float32).reshape(4, 6) % 5 - 2  # zeros among them
    uncoalesced = torch.sparse_coo_tensor(
        [[2, 0, 2], [1, 3, 1]], [1.0, 2.0, 3.0], (4, 6), check_invariants=True
    )
    empty = torch.sparse_coo_tensor(
        torch.empty(2, 0, dtype=torch.int64), [], (3, 3), check_invariants=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: compressed layouts are in beta
        return {
            "coo": dense.to_sparse(),
            "coo-uncoalesced": uncoalesced,
            "coo-hybrid": dense.to_sparse(sparse_dim=1),  # values are rows
            "coo-int": dense.to_sparse().to(torch.int64),
            "coo-empty": empty,
            "csr": dense.to_sparse_csr(),
            "csr-batched": torch.stack([dense, -dense]).to_sparse_csr(),
            "csc": dense.to_sparse_csc(),
            "bsr": dense.to_sparse_bsr((2, 3)),
            "bsc": dense.to_sparse_bsc((2, 3)),
        }


SPARSE_FORMS = _sparse_forms()


@pytest.mark.parametrize("name", sorted(SPARSE_FORMS))
def test_sparse_tensor_round_trip(name: str) -> None:
    sparse = SPARSE_FORMS[name]
    got = round_trip(sparse)
    assert got.layout == sparse.layout and got.dtype == sparse.dtype
    assert got.shape == sparse.shape and got.dense_dim() == sparse.dense_dim()
    assert torch.equal(got.to_dense(), sparse.to_dense())
    if sparse.layout is torch.sparse_coo:
        assert got.is_coalesced() == sparse.is_coalesced()
        assert torch.equal(got._indices(), sparse._indices())


def test_sparse_parts_travel_out_of_band() -> None:
    indices = torch.zeros(1, 1000, dtype=torch.int64)
    sparse = torch.sparse_coo_tensor(indices, torch.ones(1000), (5,), check_invariants=True)
    payload, buffers = dumps(sparse)
    assert sorted(len(b) for b in buffers) == [4000, 8000]  # values, then indices
    assert len(payload) < 1000


@pytest.mark.parametrize("name", ["coo", "csr"])
def test_sparse_requires_grad_and_parameter_are_kept(name: str) -> None:
    sparse = SPARSE_FORMS[name]
    got = round_trip(sparse.detach().requires_grad_())
    assert got.requires_grad and got.is_leaf and type(got) is torch.Tensor
    param = round_trip(torch.nn.Parameter(sparse.detach(), requires_grad=False))
    assert type(param) is torch.nn.Parameter and not param.requires_grad
    assert torch.equal(param.detach().to_dense(), sparse.to_dense())


def test_received_sparse_tensors_are_not_kept_alive() -> None:
    """torch's own rebuild keeps every sparse tensor in a list that only torch.load
    empties; ours keeps none."""
    import torch._utils

    pending = len(torch._utils._sparse_tensors_to_validate)
    for _ in range(5):
        round_trip(SPARSE_FORMS["coo"])
        round_trip(SPARSE_FORMS["csr"])
    assert len(torch._utils._sparse_tensors_to_validate) == pending


def test_sparse_tensor_with_an_index_out_of_bounds_is_refused() -> None:
    invalid = torch.sparse_coo_tensor([[0, 7]], [1.0, 2.0], (4,), check_invariants=False)
    payload, buffers = dumps(invalid)
    with pytest.raises(SerializationError, match="size is inconsistent with indices"):
        loads(payload, receive(buffers))


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's: TypedStorage is deprecated
def test_other_layouts_fall_back_to_torch_pickling() -> None:
    quantized = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, torch.quint8)
    got = round_trip(quantized)
    assert got.is_quantized and torch.equal(got.int_repr(), quantized.int_repr())


def test_dumps_keeps_no_reference_to_what_it_serialised() -> None:
    """The per-thread pickler is reused; its memo must not pin the last value."""
    import weakref

    tensor = torch.ones(1000)
    alive = weakref.ref(tensor)
    payload, buffers = dumps({"x": tensor, "again": [tensor]})
    del tensor, payload, buffers
    assert alive() is None  # freed by reference counting, no GC pass needed


def test_dumps_is_reentrant() -> None:
    """A reducer that serialises something itself gets its own pickler."""

    class Nested:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            inner, _ = dumps(("inner", torch.zeros(2)))
            return (bytes, (inner,))

    payload, _ = dumps(["outer", Nested()])
    outer = loads(payload, [])
    assert (
        outer[0] == "outer" and loads(outer[1], [torch.zeros(8, dtype=torch.uint8)])[0] == "inner"
    )


# -- no view of a PickleBuffer outlives a dump (CPython gh-77894) ---------------------

_BUFFERS_IN_CYCLES = """
import gc, pickle, torch
from asyncrpc.serde import dumps
gc.disable()
for i in range(200):
    payload, buffers = dumps({"t": torch.ones(1000), "i": i})
    holder = [buffers]
    holder.append(holder)  # as a failed call's traceback holds its request's buffers
    del payload, buffers, holder
gc.collect()
print("collected")
"""


def test_buffers_caught_in_reference_cycles_do_not_crash_the_collector() -> None:
    # On 3.11, memoryviews made by PickleBuffer.raw() crash the collector here (SIGSEGV).
    done = subprocess.run(
        [sys.executable, "-c", _BUFFERS_IN_CYCLES],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "collected"
    assert "exported buffer" not in done.stderr


def test_dumps_hands_out_no_view_of_a_pickle_buffer() -> None:
    _, buffers = dumps([torch.ones(10), torch.zeros(3, 3)])
    assert buffers and not any(isinstance(b.obj, pickle.PickleBuffer) for b in buffers)


class _ForeignBuffer:
    """Pickles its bytes as a PickleBuffer of its own (as numpy does)."""

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _ForeignBuffer, (pickle.PickleBuffer(self.data),)


def test_a_foreign_pickle_buffer_travels_in_the_stream() -> None:
    payload, buffers = dumps(_ForeignBuffer(b"abc" * 100))
    assert buffers == []
    assert loads(payload, []).data == b"abc" * 100


# -- numpy arrays -----------------------------------------------------------------------

np = pytest.importorskip("numpy")


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(10, dtype=np.float32),
        lambda: np.ones((4, 3), dtype=np.float64, order="F"),
        lambda: np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],
        lambda: np.arange(6, dtype=np.int16)[::-1],
        lambda: np.array([True, False]),
        lambda: np.zeros((0, 3), dtype=np.uint8),
        lambda: np.arange(3, dtype=np.complex64),
    ],
    ids=["float32", "fortran", "strided", "reversed", "bool", "empty", "complex"],
)
def test_small_numpy_arrays_round_trip_out_of_band(make: Any) -> None:
    array = make()
    payload, buffers = dumps({"obs": array})
    assert len(buffers) == 1  # the bytes travel beside the stream, not in it
    got = loads(payload, receive(buffers))["obs"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == array.dtype and got.shape == array.shape
    assert np.array_equal(got, array)
    got[...] = 0  # the receiver's copy is its own and writable


def test_a_numpy_array_is_sent_and_received_without_calling_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each call into torch releases the GIL (docs/architecture.md): an array of a
    dtype numpy has needs none on either side."""
    array = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:]

    def no_torch(*_: Any) -> Any:
        raise AssertionError("called torch")

    monkeypatch.setattr(torch, "from_numpy", no_torch)
    monkeypatch.setattr(torch, "frombuffer", no_torch)
    payload, buffers = dumps([array, np.array(2.5)])
    got, scalar = loads(payload, receive(buffers))
    assert np.array_equal(got, array) and got.strides == array.strides
    assert isinstance(scalar, np.ndarray) and scalar.shape == () and scalar == 2.5


def test_a_large_numpy_view_mostly_gaps_sends_only_its_elements() -> None:
    array = np.arange(100_000, dtype=np.float64)[::1000]
    payload, buffers = dumps(array)
    assert [len(b) for b in buffers] == [100 * 8]
    assert np.array_equal(loads(payload, receive(buffers)), array)


@pytest.mark.parametrize(
    "array",
    [
        np.array(["a", "bc"]),
        np.array([1, None], dtype=object),
        np.arange(3, dtype=">f4"),
        np.ones(2, dtype=np.longdouble),
    ],
    ids=["str", "object", "big-endian", "longdouble"],
)
def test_numpy_arrays_torch_cannot_view_travel_in_the_stream(array: Any) -> None:
    payload, buffers = dumps(array)
    assert buffers == []
    got = loads(payload, [])
    assert got.dtype == array.dtype and got.tolist() == array.tolist()


def test_read_only_numpy_array_sends_without_a_warning() -> None:
    array = np.arange(4.0)
    array.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        payload, buffers = dumps(array)
    assert np.array_equal(loads(payload, receive(buffers)), array)


def test_a_very_deep_value_raises_serialization_error_not_recursion_error() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(SerializationError, match="recursion") as caught:
        dumps(deep)
    assert len(str(caught.value)) < 300


# -- dumps_plain: values no reducer has a part in --------------------------------------


def _module_function(x: int) -> int:
    return x


PLAIN_VALUES = [
    None,
    True,
    7,
    2**80,
    1.5,
    2j,
    "text",
    b"bytes",
    _module_function,
    (_module_function, (), {}),  # a no-op call's request
    (_module_function, (1, "a", None), {"k": 2.0}),
    [1, [2, 3], {"a": 4}],
    {"nested": {"a": 1}},
    [[()], {}],  # empty containers are plain at any depth
    (((3, 17),), {}),  # a call's arguments holding an id pair (an RRef's, say)
]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_dumps_plain_pickles_what_dumps_does_without_buffers(value: Any) -> None:
    payload = dumps_plain(value)
    assert payload is not None
    assert loads(payload) == value
    assert (payload, []) == dumps(value)  # the same bytes as the reducers' path


class _Point:
    def __init__(self, x: int) -> None:
        self.x = x


class _Name(str):
    pass


NOT_PLAIN: dict[str, Callable[[], Any]] = {
    "tensor": lambda: torch.ones(2),
    "parameter": lambda: torch.nn.Parameter(torch.ones(2)),
    "ndarray": lambda: np.ones(3),
    "object": lambda: _Point(1),
    "builtin": lambda: torch.add,  # a builtin may be bound (tensor.add): reduced by its owner
    "method": lambda: _Point(1).__init__,
    "str subclass": lambda: _Name("x"),
    "dict with int keys": lambda: {1: "a"},
    "too long": lambda: (1, 2, 3, 4, 5, 6, 7, 8, 9),
    "too deep": lambda: [[[[1]]]],
    "tensor argument": lambda: (_module_function, (torch.ones(1),), {}),
    "tensor keyword": lambda: (_module_function, (), {"t": torch.ones(1)}),
}


@pytest.mark.parametrize("make", NOT_PLAIN.values(), ids=NOT_PLAIN.keys())
def test_dumps_plain_leaves_anything_else_to_dumps(make: Callable[[], Any]) -> None:
    assert dumps_plain(make()) is None


def test_dumps_plain_names_what_it_could_not_pickle() -> None:
    def local() -> None:
        pass

    with pytest.raises(SerializationError, match=r"cannot serialize .*local"):
        dumps_plain((local, (), {}))


def test_a_type_given_a_reducer_leaves_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickler, "_REDUCERS", dict(pickler._REDUCERS))
    monkeypatch.setattr(pickler, "_PLAIN_TYPES", set(pickler._PLAIN_TYPES))
    assert dumps_plain(2j) is not None
    register_reducer(complex, lambda z: (complex, (z.real, -z.imag)))
    assert dumps_plain(2j) is None
    assert loads(dumps(2j)[0]) == -2j


class _Token:
    """A small type of an upper layer that pickles into plain values by itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _Token, (self.n,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Token) and other.n == self.n

    def __hash__(self) -> int:
        return hash(self.n)


def test_a_type_registered_plain_travels_on_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickler, "_PLAIN_TYPES", set(pickler._PLAIN_TYPES))
    call = (_module_function, (_Token(3), 1), {})
    assert dumps_plain(call) is None
    register_plain(_Token)
    payload = dumps_plain(call)
    assert payload is not None
    assert loads(payload) == call
    assert (payload, []) == dumps(call)  # what the reducers' path makes of it too


def test_a_type_with_a_reducer_cannot_be_registered_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickler, "_REDUCERS", dict(pickler._REDUCERS))
    register_reducer(_Token, lambda t: (_Token, (t.n,)))
    with pytest.raises(ValueError, match="has a reducer"):
        register_plain(_Token)


def test_a_value_of_many_small_tensors_keeps_a_bounded_number_of_buffers() -> None:
    """Each out-of-band buffer is a descriptor in the frame's header (64 KiB): past
    ``OUT_OF_BAND_MAX`` a small one is copied into the payload, a large one never is."""
    small = [torch.full((3,), float(i)) for i in range(20_000)]
    large = torch.arange(pickler.IN_BAND_BELOW // 4, dtype=torch.float32)
    value = [*small[:10_000], large, *small[10_000:]]
    payload, buffers = dumps(value)
    assert len(buffers) == pickler.OUT_OF_BAND_MAX + 1
    assert any(buf.nbytes == large.nbytes for buf in buffers[pickler.OUT_OF_BAND_MAX :])
    got = loads(payload, receive(buffers))
    assert len(got) == len(value)
    for received, sent in zip(got, value, strict=True):
        assert_same_tensor(received, sent)
    in_band = got[-1]
    in_band.add_(1)  # writable, and its own memory: the sender's tensor is untouched
    assert in_band.tolist() == [20_000.0] * 3 and small[-1].tolist() == [19_999.0] * 3


class Staged:
    """Bytes still being written when pickled, as a CUDA tensor's host copy is."""

    def __init__(self, data: bytearray) -> None:
        self.data = data


def _rebuild_staged(buffer: Any) -> Staged:
    return Staged(bytearray(buffer))


def test_a_staged_buffer_stays_out_of_band_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its bytes are copied only once staged (before the message leaves), never into the
    payload while it is pickled."""
    monkeypatch.setattr(pickler, "_REDUCERS", dict(pickler._REDUCERS))
    monkeypatch.setattr(pickler, "_PLAIN_TYPES", set(pickler._PLAIN_TYPES))

    def reduce_staged(obj: Staged) -> Any:
        return _rebuild_staged, (pickler._out_of_band(memoryview(obj.data), staged=True),)

    register_reducer(Staged, reduce_staged)
    small = [torch.full((1,), float(i)) for i in range(pickler.OUT_OF_BAND_MAX + 5)]
    staged = Staged(bytearray(b"not yet"))
    payload, buffers = dumps([*small, staged])
    assert len(buffers) == pickler.OUT_OF_BAND_MAX + 1
    staged.data[:] = b"written"  # the copy finishes after pickling
    got = loads(payload, receive(buffers))
    assert got[-1].data == bytearray(b"written") and got[-2].item() == len(small) - 1
