"""Unit tests for StoragePool: warm memory for large buffers received through a socket."""

from __future__ import annotations

import ctypes
import gc
import mmap
import time

import numpy as np
import torch

from asyncrpc.serde import allocate_tensor_storage
from asyncrpc.serde.tensors import load_tensor
from asyncrpc.transport.storage import PREFAULT_PIECE, StoragePool

MB = 1 << 20


def received(pool: StoragePool, nbytes: int, fill: int = 7) -> torch.Tensor:
    """A uint8 tensor as a receiver builds it: allocate, the kernel fills, rebuild."""
    owner, view = pool.allocate(nbytes)
    view[:] = bytes([fill]) * nbytes
    return load_tensor(("uint8", (nbytes,), (1,), False, "cpu", False), owner)


def test_small_buffers_are_fresh_storage() -> None:
    pool = StoragePool(allocate_tensor_storage)
    owner, view = pool.allocate(1000)
    assert isinstance(owner, np.ndarray) and len(view) == 1000
    assert pool.created == pool.reused == 0


def test_a_mapping_is_reused_once_its_tensors_died() -> None:
    pool = StoragePool(allocate_tensor_storage)
    first = received(pool, 2 * MB)
    view = first[10:20]
    del first
    gc.collect()
    assert pool.idle_bytes == 0  # a view still uses it
    assert bool((view == 7).all())
    del view
    assert pool.idle_bytes == 2 * MB
    second = received(pool, 2 * MB - 100, fill=9)
    assert (pool.created, pool.reused, pool.idle_bytes) == (1, 1, 0)
    assert bool((second == 9).all()) and second.numel() == 2 * MB - 100


def test_a_live_tensor_is_never_handed_out_again() -> None:
    pool = StoragePool(allocate_tensor_storage)
    first = received(pool, 2 * MB, fill=1)
    second = received(pool, 2 * MB, fill=2)
    assert pool.created == 2
    assert bool((first == 1).all()) and bool((second == 2).all())


def test_too_large_a_mapping_is_not_reused() -> None:
    pool = StoragePool(allocate_tensor_storage)
    received(pool, 4 * MB)  # dropped at once: its mapping goes idle
    received(pool, 2 * MB)  # 4 MB would waste half: a new one
    assert (pool.created, pool.reused) == (2, 0)


def test_idle_memory_is_bounded_but_the_newest_stays() -> None:
    pool = StoragePool(allocate_tensor_storage, max_idle_bytes=3 * MB, idle_grace=0.0)
    a, b = received(pool, 2 * MB), received(pool, 4 * MB)
    del a
    del b
    time.sleep(0.01)
    pool.trim()
    assert pool.idle_bytes == 4 * MB  # the one returned last
    pool.clear()
    assert pool.idle_bytes == 0


def resident_pages(view: memoryview) -> int:
    """How many pages of ``view`` (page-aligned, as a mapping's) are in memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-len(view) // mmap.PAGESIZE)
    flags = ctypes.create_string_buffer(pages)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert libc.mincore(address, len(view), flags) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in flags.raw)


def test_a_new_mapping_is_faulted_in_ahead_of_the_bytes_keeping_what_they_wrote() -> None:
    pool = StoragePool(allocate_tensor_storage)
    nbytes = 3 * PREFAULT_PIECE + mmap.PAGESIZE  # a last piece shorter than the others
    _, view = pool.allocate(nbytes)
    view[: 2 * MB] = b"\x07" * (2 * MB)  # the socket writes while the thread faults
    pages = nbytes // mmap.PAGESIZE
    deadline = time.monotonic() + 10
    while resident_pages(view) < pages:  # the prefault thread is not done yet
        assert time.monotonic() < deadline, f"{resident_pages(view)} of {pages} pages in"
        time.sleep(0.001)
    assert view[: 2 * MB] == b"\x07" * (2 * MB) and view[2 * MB :] == bytes(nbytes - 2 * MB)
    pool.close()
