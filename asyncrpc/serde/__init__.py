"""Serialisation: values <-> (pickle payload, zero-copy tensor buffers)."""

from asyncrpc.serde.pickler import (
    dumps,
    dumps_plain,
    is_plain,
    loads,
    reduce_tensor,
    register_plain,
    register_reducer,
)
from asyncrpc.serde.tensors import allocate_tensor_storage, byte_view

__all__ = (
    "allocate_tensor_storage",
    "byte_view",
    "dumps",
    "dumps_plain",
    "is_plain",
    "loads",
    "reduce_tensor",
    "register_plain",
    "register_reducer",
)
