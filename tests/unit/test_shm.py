"""Unit tests for the same-host shared-memory path (SegmentPool, SegmentMapper).

Sender and receiver are both this process: /proc/<our pid>/fd/<fd> names our own
segment, which is exactly what a receiver on the same host opens.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.wire import ExternalRef

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"),
    reason="shared-memory segments need Linux memfd and /proc",
)

if sys.platform.startswith("linux"):
    from asyncrpc.transport.shm import SegmentMapper, SegmentPool, host_identity

MiB = 1 << 20


def data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + n).randbytes(n)


class Releases:
    """An on_release callback that records the keys it was called with."""

    def __init__(self) -> None:
        self.keys: list[int] = []

    def __call__(self, key: int) -> None:
        self.keys.append(key)


@pytest.fixture
def pool() -> Iterator[SegmentPool]:
    p = SegmentPool()
    yield p
    p.close()


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def test_put_copies_the_data(pool: SegmentPool) -> None:
    source = bytearray(data(3 * MiB + 5, 1))
    ref = pool.put(memoryview(source), owner="link")
    assert isinstance(ref, ExternalRef)
    assert ref.nbytes == len(source)
    expected = bytes(source)
    source[:] = bytes(len(source))  # the segment holds a copy, not a view of the source
    memory = SegmentMapper(os.getpid()).view(ref, Releases())
    assert len(memory) == ref.nbytes
    assert memory[:] == expected
    assert pool.stats == {"segments_in_use": 1, "segments_idle": 0, "idle_bytes": 0}


def test_segment_fd_is_a_named_memfd(pool: SegmentPool) -> None:
    ref = pool.put(memoryview(data(100)), owner="link")
    assert os.readlink(f"/proc/self/fd/{fd_of(ref)}").startswith("/memfd:asyncrpc-segment")


def test_mapping_is_shared_with_the_sender(pool: SegmentPool) -> None:
    ref = pool.put(memoryview(data(MiB, 2)), owner="link")
    first = SegmentMapper(os.getpid()).view(ref, Releases())
    second = SegmentMapper(os.getpid()).view(ref, Releases())
    first[:4] = b"\xde\xad\xbe\xef"
    assert second[:4] == b"\xde\xad\xbe\xef"  # MAP_SHARED: one set of pages


def test_map_segment_does_not_leak_descriptors(pool: SegmentPool) -> None:
    """The module promises: open, map, close the descriptor; the mapping holds no fd."""
    ref = pool.put(memoryview(data(MiB, 3)), owner="link")
    before = open_fds()
    memory = SegmentMapper(os.getpid()).view(ref, Releases())
    assert open_fds() == before
    del memory


def test_dropping_the_mapping_calls_on_release_with_the_key(pool: SegmentPool) -> None:
    ref = pool.put(memoryview(data(MiB, 4)), owner="link")
    released = Releases()
    memory = SegmentMapper(os.getpid()).view(ref, released)
    assert released.keys == []
    del memory
    gc.collect()
    assert released.keys == [ref.key]


def test_tensor_over_the_mapping_keeps_it_alive(pool: SegmentPool) -> None:
    """The transport makes the mapping a tensor's storage: release waits for the tensor."""
    payload = data(2 * MiB, 5)
    ref = pool.put(memoryview(payload), owner="link")
    released = Releases()
    memory = SegmentMapper(os.getpid()).view(ref, released)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    del memory
    gc.collect()
    assert released.keys == []
    assert bytes(tensor[:64].numpy()) == payload[:64]
    assert bytes(tensor[-64:].numpy()) == payload[-64:]
    del tensor
    gc.collect()
    assert released.keys == [ref.key]


def test_release_makes_the_segment_reusable(pool: SegmentPool) -> None:
    first = pool.put(memoryview(data(3 * MiB, 6)), owner="link")
    pool.release([first.key], owner="link")
    stats = pool.stats
    assert stats["segments_in_use"] == 0 and stats["segments_idle"] == 1
    assert stats["idle_bytes"] >= 3 * MiB
    payload = data(3 * MiB - 1000, 7)
    second = pool.put(memoryview(payload), owner="link")
    assert second.key == first.key  # the same fd: reused, not created
    assert second.nbytes == len(payload)
    assert pool.stats == {"segments_in_use": 1, "segments_idle": 0, "idle_bytes": 0}
    memory = SegmentMapper(os.getpid()).view(second, Releases())
    assert memory[:] == payload


def test_reuse_creates_no_new_descriptor(pool: SegmentPool) -> None:
    ref = pool.put(memoryview(data(MiB, 8)), owner="link")
    pool.release([ref.key], owner="link")
    before = open_fds()
    again = pool.put(memoryview(data(MiB, 9)), owner="link")
    assert open_fds() == before
    assert again.key == ref.key


def test_unreleased_segment_is_not_reused(pool: SegmentPool) -> None:
    first = pool.put(memoryview(data(MiB, 10)), owner="link")
    second = pool.put(memoryview(data(MiB, 11)), owner="link")
    assert first.key != second.key
    assert pool.stats["segments_in_use"] == 2
    # The first receiver still sees its own bytes.
    assert SegmentMapper(os.getpid()).view(first, Releases())[:] == data(MiB, 10)


def test_much_smaller_buffer_does_not_take_a_huge_idle_segment(pool: SegmentPool) -> None:
    big = pool.put(memoryview(data(16 * MiB, 12)), owner="link")
    pool.release([big.key], owner="link")
    small = pool.put(memoryview(data(MiB, 13)), owner="link")
    assert small.key != big.key
    assert pool.stats["segments_idle"] == 1


def test_release_by_another_owner_is_ignored(pool: SegmentPool) -> None:
    ref = pool.put(memoryview(data(MiB, 14)), owner="link-a")
    pool.release([ref.key], owner="link-b")
    pool.release([ref.key + 1000], owner="link-a")  # unknown keys are ignored too
    assert pool.stats["segments_in_use"] == 1
    assert pool.stats["segments_idle"] == 0


def test_double_release_is_harmless(pool: SegmentPool) -> None:
    ref = pool.put(memoryview(data(MiB, 15)), owner="link")
    pool.release([ref.key, ref.key], owner="link")
    pool.release([ref.key], owner="link")
    assert pool.stats["segments_idle"] == 1
    assert pool.stats["segments_in_use"] == 0


def test_forget_closes_the_owners_in_use_segments(pool: SegmentPool) -> None:
    mine = pool.put(memoryview(data(MiB, 16)), owner="lost")
    mapped = SegmentMapper(os.getpid()).view(mine, Releases())
    other = pool.put(memoryview(data(MiB, 17)), owner="alive")
    pool.forget("lost")
    assert pool.stats == {"segments_in_use": 1, "segments_idle": 0, "idle_bytes": 0}
    with pytest.raises(OSError):
        os.fstat(fd_of(mine))  # closed on the sender's side
    assert mapped[:] == data(MiB, 16)  # a living receiver keeps its mapping
    # Its late release changes nothing, and the other owner's segment is untouched.
    pool.release([mine.key], owner="lost")
    assert pool.stats["segments_idle"] == 0
    assert SegmentMapper(os.getpid()).view(other, Releases())[:] == data(MiB, 17)


def test_trim_closes_idle_segments_beyond_the_limit() -> None:
    pool = SegmentPool(max_idle_bytes=5 * MiB)
    try:
        refs = [pool.put(memoryview(data(n * MiB, n)), owner="link") for n in (1, 3, 7)]
        pool.release([r.key for r in refs], owner="link")
        stats = pool.stats
        assert stats["idle_bytes"] <= 5 * MiB
        assert stats["segments_idle"] >= 1
        assert stats["segments_in_use"] == 0
    finally:
        pool.close()


def test_close_closes_every_segment() -> None:
    pool = SegmentPool()
    idle = pool.put(memoryview(data(MiB, 18)), owner="link")
    busy = pool.put(memoryview(data(MiB, 19)), owner="link")
    pool.release([idle.key], owner="link")
    pool.close()
    assert pool.stats == {"segments_in_use": 0, "segments_idle": 0, "idle_bytes": 0}
    for key in (idle.key, busy.key):
        with pytest.raises(OSError):
            os.fstat(fd_of_key(key))


def fd_of_key(key: int) -> int:
    """A segment key carries the sender's descriptor in its low 32 bits."""
    return key & 0xFFFFFFFF


def fd_of(ref: ExternalRef) -> int:
    return fd_of_key(ref.key)


def test_a_cached_mapping_serves_later_transfers_of_the_segment(pool: SegmentPool) -> None:
    mapper = SegmentMapper(os.getpid())
    first = pool.put(memoryview(data(MiB, 30)), owner="link")
    released = Releases()
    view = mapper.view(first, released)
    del view
    assert released.keys == [first.key]
    pool.release(released.keys, owner="link")
    second = pool.put(memoryview(data(MiB, 31)), owner="link")
    assert second.key == first.key
    assert mapper.view(second, Releases())[:] == data(MiB, 31)  # same mapping, new bytes


def test_map_segment_rejects_a_regular_file() -> None:
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * 4096)
        f.flush()
        ref = ExternalRef(f.fileno(), 4096)
        with pytest.raises(RemoteProtocolError, match="not an asyncrpc segment"):
            SegmentMapper(os.getpid()).view(ref, Releases())


def test_map_segment_rejects_a_foreign_memfd() -> None:
    fd = os.memfd_create("someone-else")
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(RemoteProtocolError, match="not an asyncrpc segment"):
            SegmentMapper(os.getpid()).view(ExternalRef(fd, 4096), Releases())
    finally:
        os.close(fd)


def test_map_segment_rejects_a_pipe() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(RemoteProtocolError):
            SegmentMapper(os.getpid()).view(ExternalRef(r, 10), Releases())
    finally:
        os.close(r)
        os.close(w)


def test_map_segment_rejects_a_closed_descriptor() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(RemoteProtocolError, match="cannot open"):
        SegmentMapper(os.getpid()).view(ExternalRef(r, 10), Releases())


def test_map_segment_rejects_a_ref_larger_than_the_segment(pool: SegmentPool) -> None:
    ref = pool.put(memoryview(data(MiB, 20)), owner="link")
    size = os.fstat(fd_of(ref)).st_size
    released = Releases()
    with pytest.raises(RemoteProtocolError, match="does not hold"):
        SegmentMapper(os.getpid()).view(ExternalRef(ref.key, size + 1), released)
    gc.collect()
    assert released.keys == []  # nothing was mapped, so nothing is released


@pytest.mark.parametrize("nbytes", [0, -1])
def test_map_segment_rejects_empty_or_negative_refs(pool: SegmentPool, nbytes: int) -> None:
    ref = pool.put(memoryview(data(MiB, 21)), owner="link")
    with pytest.raises(RemoteProtocolError, match="does not hold"):
        SegmentMapper(os.getpid()).view(ExternalRef(ref.key, nbytes), Releases())


def test_map_segment_of_a_missing_process() -> None:
    # pid_max is at most 2**22 on Linux, so this pid cannot exist.
    with pytest.raises(RemoteProtocolError, match="cannot open"):
        SegmentMapper(2**22 + 17).view(ExternalRef(3, 10), Releases())


def test_host_identity_is_stable_in_a_process() -> None:
    assert host_identity() == host_identity()
    assert host_identity()
