"""serde.lean: values whose only parts beyond pickle's own are CPU tensors and arrays."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.serde import allocate_tensor_storage, dumps, loads, pickler, register_reducer
from asyncrpc.serde.lean import (
    _DIMENSION_BYTES,
    _ENTRY_BYTES,
    ENTRIES_MAX,
    ENTRIES_ROOM,
    _fit,
    dumps_lean,
    loads_lean,
)
from asyncrpc.wire.codec import MAX_HEADER_SIZE


def receive(buffers: list[memoryview]) -> list[Any]:
    """What the transport does: fresh storage per buffer, the bytes copied in."""
    received = []
    for buffer in buffers:
        storage, view = allocate_tensor_storage(len(buffer))
        view[:] = buffer
        received.append(storage)
    return received


def round_trip(value: Any) -> Any:
    """Through dumps_lean, a header (msgpack: entries arrive as lists) and loads_lean."""
    dumped = dumps_lean(value)
    assert dumped is not None, f"{value!r} was not lean"
    payload, entries, buffers = dumped
    header = msgpack.unpackb(msgpack.packb({"t": entries}))
    return loads_lean(payload, header["t"], receive(buffers))


def assert_same_tensor(got: Any, want: torch.Tensor) -> None:
    assert type(got) is torch.Tensor
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert torch.equal(got, want) and not got.requires_grad


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4),
        lambda: torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # strides kept
        lambda: torch.arange(20, dtype=torch.int16)[2:17:3],  # a view with gaps
        lambda: torch.ones(3, dtype=torch.bfloat16),  # numpy has no bfloat16
        lambda: torch.tensor([True, False, True]),
        lambda: torch.zeros((2, 0, 3)),  # no elements
        lambda: torch.tensor(7.5),  # no dimensions
        lambda: torch.arange(6.0).to(torch.complex64).conj(),  # its lazy bit applied
    ],
    ids=["matrix", "transposed", "gaps", "bfloat16", "bool", "empty", "scalar", "conj"],
)
def test_tensors_alone_and_inside_values_arrive_equal(make: Any) -> None:
    tensor = make()
    want = tensor.resolve_conj()
    assert_same_tensor(round_trip(tensor), want)
    args, kwargs = round_trip(((tensor, 3, "x"), {"k": [tensor.clone(), None]}))
    assert_same_tensor(args[0], want) and assert_same_tensor(kwargs["k"][0], want)
    assert args[1:] == (3, "x") and kwargs["k"][1] is None


def test_arrays_arrive_as_arrays_over_the_received_memory() -> None:
    array = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    got = round_trip(array)
    assert type(got) is np.ndarray and got.dtype == array.dtype
    assert np.array_equal(got, array) and got.strides == array.strides
    got[0, 0] = 99  # writable, and its own
    assert array[0, 0] == 0


def test_a_tensor_met_twice_arrives_as_one_object_with_one_buffer() -> None:
    tensor = torch.ones(4)
    dumped = dumps_lean((tensor, [tensor], {"again": tensor}))
    assert dumped is not None and len(dumped[1]) == len(dumped[2]) == 1
    first, (second,), third = round_trip((tensor, [tensor], {"again": tensor}))
    assert first is second is third["again"]


def test_a_tensor_alone_skips_the_pickler_at_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = torch.arange(5.0)
    dumped = dumps_lean(tensor)
    assert dumped is not None
    payload, entries, buffers = dumped
    assert (len(entries), len(buffers)) == (1, 1)
    monkeypatch.setattr(pickle, "Unpickler", None)  # not needed to rebuild it
    assert_same_tensor(loads_lean(payload, [list(entries[0])], receive(buffers)), tensor)


def test_bytes_leave_zero_copy_as_views_of_the_tensor() -> None:
    tensor = torch.arange(1000, dtype=torch.int64)
    dumped = dumps_lean(((tensor,), {}))
    assert dumped is not None
    (view,) = dumped[2]
    assert isinstance(view, memoryview) and view.nbytes == tensor.nbytes
    tensor[0] = 42
    assert int(np.frombuffer(view, np.int64)[0]) == 42


class Serialises:
    """Pickles something else while it is pickled (as an object holding a cache of its
    own serialised form may)."""

    def __reduce__(self) -> Any:
        assert dumps_lean(((torch.ones(2), 5), {})) is not None
        return int, (3,)


def test_a_value_that_serialises_while_it_is_pickled_is_pickled_too() -> None:
    tensor = torch.arange(4.0)
    (got, three, text), kwargs = round_trip(((tensor, Serialises(), "x"), {}))
    assert_same_tensor(got, tensor)
    assert (three, text, kwargs) == (3, "x", {})


class Registered:
    pass


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's, on quantized tensors
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2, requires_grad=True),  # distributed autograd records these
        lambda: torch.nn.Parameter(torch.ones(2)),
        lambda: torch.ones(4).to_sparse(),
        lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),
        lambda: torch.empty(2, device="meta"),
        lambda: np.arange(4)[::-1],  # a negative stride: numpy's own reduction
        Registered,
        lambda: lambda: 1,  # pickle refuses it: dumps says why
    ],
    ids=["requires_grad", "parameter", "sparse", "quantized", "meta", "reversed", "reg", "lambda"],
)
def test_anything_a_reducer_must_see_is_left_to_dumps(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pickler, "_REDUCERS", dict(pickler._REDUCERS))
    monkeypatch.setattr(pickler, "_PLAIN_TYPES", set(pickler._PLAIN_TYPES))
    monkeypatch.setattr("asyncrpc.serde.lean._REDUCERS", pickler._REDUCERS)
    register_reducer(Registered, lambda obj: (Registered, ()))
    value = make()
    assert dumps_lean(value) is None
    assert dumps_lean(((torch.ones(1), value), {})) is None  # however deep
    if not callable(value) or isinstance(value, torch.Tensor):
        payload, buffers = dumps(value)  # which takes it
        assert type(loads(payload, receive(buffers))) is type(value)


def test_values_of_pickle_alone_are_lean_without_entries() -> None:
    value = ([float(i) for i in range(50)], {"nested": {"deep": (1, 2)}})
    dumped = dumps_lean(value)
    assert dumped is not None and dumped[1] == [] and dumped[2] == []
    assert loads_lean(dumped[0], [], []) == value


@pytest.mark.parametrize(
    ("entries", "buffers"),
    [
        ("not a list", [b"1234"]),
        ([["t", "float32", [1], [1]]], []),  # fewer buffers than entries
        ([["x", "float32", [1], [1]]], [bytearray(4)]),  # an unknown kind
        ([["t", "float99", [1], [1]]], [bytearray(4)]),  # an unknown dtype
        ([["t", "float32", [1000], [1]]], [bytearray(4)]),  # more than its buffer holds
        ([["t", "float32"]], [bytearray(4)]),  # a short entry
    ],
    ids=["not-a-list", "count", "kind", "dtype", "overrun", "short"],
)
def test_malformed_entries_are_refused_with_a_serialization_error(
    entries: Any, buffers: list[Any]
) -> None:
    payload = dumps_lean(torch.ones(1))
    assert payload is not None
    with pytest.raises(SerializationError):
        loads_lean(payload[0], entries, buffers)


def test_a_garbage_payload_is_refused_with_a_serialization_error() -> None:
    with pytest.raises(SerializationError):
        loads_lean(b"\x80\x05garbage", [], [])
    with pytest.raises(SerializationError):  # a persistent id with no tensor behind it
        loads_lean(
            pickle.PROTO + b"\x05" + pickle.BININT1 + b"\x03" + pickle.BINPERSID + b".", [], []
        )


def test_a_model_sized_value_of_tensors_travels_lean() -> None:
    """A state dict or gradient list of a thousand tensors fits a frame's header."""
    model = {f"layer{i}.weight": torch.full((16, 16, 3, 3), float(i)) for i in range(1000)}
    dumped = dumps_lean(model)
    assert dumped is not None
    payload, entries, buffers = dumped
    assert len(entries) == 1000
    got = loads_lean(payload, entries, receive(buffers))
    assert list(got) == list(model)
    for name, tensor in model.items():
        assert_same_tensor(got[name], tensor)


def test_more_tensors_than_a_header_has_room_for_are_left_to_dumps() -> None:
    """Past ``ENTRIES_MAX`` tensors and arrays, or ``ENTRIES_ROOM`` bytes of entries (a
    few hundred tensors of many dimensions), a value takes ``dumps`` (their metadata in
    its payload)."""
    most = [torch.full((2,), float(i)) for i in range(ENTRIES_MAX)]
    assert dumps_lean(most) is not None
    assert dumps_lean([*most, np.zeros(2)]) is None
    wide = [torch.ones((1,) * 60) for _ in range(600)]  # ~130 bytes an entry
    assert dumps_lean(wide[:300]) is not None
    assert dumps_lean(wide) is None


def test_entries_that_fit_leave_room_for_the_rest_of_the_header() -> None:
    narrow = ("t", "float8_e4m3fnuz", (2**40,) * 4, (2**40,) * 4)  # as long as 4-d ones get
    wide = ("t", "float32", (1,) * 60, (1,) * 60)
    for entry in (narrow, wide):
        ndim = len(entry[2])
        assert len(msgpack.packb(entry)) <= _ENTRY_BYTES + _DIMENSION_BYTES * ndim
        for count in (1, 16, 100, 400, 500, 600, 1000):
            packed = len(msgpack.packb([entry] * count)) + 9 * count
            assert _fit([entry] * count, ndim) == (packed <= ENTRIES_ROOM)
    assert ENTRIES_ROOM < MAX_HEADER_SIZE


class _PickledWhilePickling:
    """An object whose reduction serialises a value of its own, as a lean message."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        inner = round_trip(("inner", torch.arange(3.0)))
        return (tuple, ((inner[0], inner[1].tolist()),))


def test_a_lean_dump_inside_a_lean_dump_gets_a_pickler_of_its_own() -> None:
    outer = round_trip(["outer", _PickledWhilePickling(), torch.ones(2)])
    assert outer[0] == "outer" and outer[1] == ("inner", [0.0, 1.0, 2.0])
    assert_same_tensor(outer[2], torch.ones(2))
    assert_same_tensor(round_trip(torch.zeros(4)), torch.zeros(4))  # the thread's, reset
