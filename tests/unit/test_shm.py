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
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.wire import ExternalRef

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"),
    reason="shared-memory segments need Linux memfd and /proc",
)

if sys.platform.startswith("linux"):
    from asyncrpc.transport import shm
    from asyncrpc.transport.housekeeping import Copiers
    from asyncrpc.transport.shm import (
        DEFAULT_BUDGET,
        GRANULE,
        SegmentMapper,
        SegmentPool,
        fill_all,
    )

MiB = 1 << 20


def data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + n).randbytes(n)


class Owner:
    """A stand-in for a link: segments are lent to it, and it hears which were closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed: list[int] = []
        self.told = threading.Event()

    def segments_closed(self, keys: list[int]) -> None:
        self.closed.extend(keys)
        self.told.set()


LINK, LINK_A, LINK_B, LOST, ALIVE = (Owner(n) for n in ("link", "a", "b", "lost", "alive"))


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


def put(pool: SegmentPool, payload: bytes | bytearray, owner: Owner) -> ExternalRef:
    """``pool.put`` where the budget has room: a reference, never None."""
    ref = pool.put(memoryview(payload), owner)
    assert ref is not None
    return ref


def counts(pool: SegmentPool) -> tuple[int, int, int]:
    """Segments in use, idle segments, idle bytes."""
    stats = pool.stats
    return stats["segments_in_use"], stats["segments_idle"], stats["bytes_idle"]


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def test_put_copies_the_data(pool: SegmentPool) -> None:
    source = bytearray(data(3 * MiB + 5, 1))
    ref = put(pool, source, LINK)
    assert isinstance(ref, ExternalRef)
    assert ref.nbytes == len(source)
    expected = bytes(source)
    source[:] = bytes(len(source))  # the segment holds a copy, not a view of the source
    memory = SegmentMapper(os.getpid()).view(ref, Releases())
    assert len(memory) == ref.nbytes
    assert memory[:] == expected
    assert counts(pool) == (1, 0, 0)


def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (bounded) for another thread to make ``condition()`` true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.001)


def test_fill_later_copies_on_a_copier_thread_and_counts_copies_in_flight(
    pool: SegmentPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    copied_on: list[str] = []

    def held_fill_all(fills: list[tuple[shm.Segment, memoryview]], helpers: Copiers) -> None:
        copied_on.append(threading.current_thread().name)
        assert gate.wait(10)
        fill_all(fills, helpers)

    monkeypatch.setattr(shm, "fill_all", held_fill_all)
    source = data(2 * MiB, 4)
    segment = pool.lend(len(source), LINK)
    assert segment is not None
    job = pool.fill_later([(segment, memoryview(source))])
    assert pool.copying == 1
    gate.set()
    job.result(timeout=10)
    until(lambda: pool.copying == 0, "the copy counted as done")
    assert copied_on and copied_on[0].startswith("asyncrpc-shm-copy")
    view = SegmentMapper(os.getpid()).view(segment.ref(len(source)), Releases())
    assert view[:] == source


def test_a_failed_fill_later_is_the_jobs_error_and_no_copy_stays_counted(
    pool: SegmentPool,
) -> None:
    segment = pool.lend(2 * MiB, LINK)
    assert segment is not None
    segment.close()
    job = pool.fill_later([(segment, memoryview(data(2 * MiB, 5)))])
    with pytest.raises(OSError, match="closed"):
        job.result(timeout=10)
    until(lambda: pool.copying == 0, "the failed copy counted as done")


def test_segment_fd_is_a_named_memfd(pool: SegmentPool) -> None:
    ref = put(pool, data(100), LINK)
    assert os.readlink(f"/proc/self/fd/{fd_of(ref)}").startswith("/memfd:asyncrpc-segment")


def test_mapping_is_shared_with_the_sender(pool: SegmentPool) -> None:
    ref = put(pool, data(MiB, 2), LINK)
    first = SegmentMapper(os.getpid()).view(ref, Releases())
    second = SegmentMapper(os.getpid()).view(ref, Releases())
    first[:4] = b"\xde\xad\xbe\xef"
    assert second[:4] == b"\xde\xad\xbe\xef"  # MAP_SHARED: one set of pages


def test_map_segment_does_not_leak_descriptors(pool: SegmentPool) -> None:
    """The module promises: open, map, close the descriptor; the mapping holds no fd."""
    ref = put(pool, data(MiB, 3), LINK)
    before = open_fds()
    memory = SegmentMapper(os.getpid()).view(ref, Releases())
    assert open_fds() == before
    del memory


def test_dropping_the_mapping_calls_on_release_with_the_key(pool: SegmentPool) -> None:
    ref = put(pool, data(MiB, 4), LINK)
    released = Releases()
    memory = SegmentMapper(os.getpid()).view(ref, released)
    assert released.keys == []
    del memory
    gc.collect()
    assert released.keys == [ref.key]


def test_tensor_over_the_mapping_keeps_it_alive(pool: SegmentPool) -> None:
    """The transport makes the mapping a tensor's storage: release waits for the tensor."""
    payload = data(2 * MiB, 5)
    ref = put(pool, payload, LINK)
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
    first = put(pool, data(3 * MiB, 6), LINK)
    pool.release([first.key], owner=LINK)
    stats = pool.stats
    assert stats["segments_in_use"] == 0 and stats["segments_idle"] == 1
    assert stats["bytes_idle"] >= 3 * MiB
    payload = data(3 * MiB - 1000, 7)
    second = put(pool, payload, LINK)
    assert second.key == first.key  # the same fd: reused, not created
    assert second.nbytes == len(payload)
    assert counts(pool) == (1, 0, 0)
    memory = SegmentMapper(os.getpid()).view(second, Releases())
    assert memory[:] == payload


def test_reuse_creates_no_new_descriptor(pool: SegmentPool) -> None:
    ref = put(pool, data(MiB, 8), LINK)
    pool.release([ref.key], owner=LINK)
    before = open_fds()
    again = put(pool, data(MiB, 9), LINK)
    assert open_fds() == before
    assert again.key == ref.key


def test_unreleased_segment_is_not_reused(pool: SegmentPool) -> None:
    first = put(pool, data(MiB, 10), LINK)
    second = put(pool, data(MiB, 11), LINK)
    assert first.key != second.key
    assert pool.stats["segments_in_use"] == 2
    # The first receiver still sees its own bytes.
    assert SegmentMapper(os.getpid()).view(first, Releases())[:] == data(MiB, 10)


def test_much_smaller_buffer_does_not_take_a_huge_idle_segment(pool: SegmentPool) -> None:
    big = put(pool, data(16 * MiB, 12), LINK)
    pool.release([big.key], owner=LINK)
    small = put(pool, data(MiB, 13), LINK)
    assert small.key != big.key
    assert pool.stats["segments_idle"] == 1


def test_release_by_another_owner_is_ignored(pool: SegmentPool) -> None:
    ref = put(pool, data(MiB, 14), LINK_A)
    pool.release([ref.key], owner=LINK_B)
    pool.release([ref.key + 1000], owner=LINK_A)  # unknown keys are ignored too
    assert pool.stats["segments_in_use"] == 1
    assert pool.stats["segments_idle"] == 0


def test_double_release_is_harmless(pool: SegmentPool) -> None:
    ref = put(pool, data(MiB, 15), LINK)
    pool.release([ref.key, ref.key], owner=LINK)
    pool.release([ref.key], owner=LINK)
    assert pool.stats["segments_idle"] == 1
    assert pool.stats["segments_in_use"] == 0


def test_forget_closes_the_owners_in_use_segments(pool: SegmentPool) -> None:
    mine = put(pool, data(MiB, 16), LOST)
    mapped = SegmentMapper(os.getpid()).view(mine, Releases())
    other = put(pool, data(2 * MiB, 17), ALIVE)
    assert pool.stats["bytes_in_use"] == 3 * MiB
    pool.forget(LOST)
    assert counts(pool) == (1, 0, 0)
    assert pool.stats["bytes_in_use"] == 2 * MiB  # the other owner's segment only
    with pytest.raises(OSError):
        os.fstat(fd_of(mine))  # closed on the sender's side
    assert mapped[:] == data(MiB, 16)  # a living receiver keeps its mapping
    # Its late release changes nothing, and the other owner's segment is untouched.
    pool.release([mine.key], owner=LOST)
    assert pool.stats["segments_idle"] == 0
    assert SegmentMapper(os.getpid()).view(other, Releases())[:] == data(2 * MiB, 17)


def test_trim_closes_the_oldest_idle_segments_beyond_the_limit_but_never_the_newest() -> None:
    pool = SegmentPool(max_idle_bytes=5 * MiB, idle_grace=0)
    owner = Owner("link")
    try:
        refs = [put(pool, data(n * MiB, n), owner) for n in (1, 3, 2, 7)]
        keys = [r.key for r in refs]
        pool.release(keys[:3], owner=owner)  # 6 MiB idle: the oldest (1 MiB) goes
        assert sorted(owner.closed) == [keys[0]]
        assert pool.stats["bytes_idle"] == 5 * MiB
        pool.release(keys[3:], owner=owner)  # the newest (7 MiB) stays, alone
        assert sorted(owner.closed) == sorted(keys[:3])
        assert counts(pool) == (0, 1, 7 * MiB)
        for key in keys[:3]:
            with pytest.raises(OSError):
                os.fstat(fd_of_key(key))
    finally:
        pool.close()


def test_idle_segments_beyond_the_limit_are_trimmed_once_their_grace_is_over() -> None:
    """Within the grace a repeated transfer finds its segments warm; after it, the
    housekeeping thread closes them even if nothing else happens."""
    pool = SegmentPool(max_idle_bytes=0, idle_grace=0.2)
    owner = Owner("link")
    try:
        refs = [put(pool, data(n * MiB, n), owner) for n in (1, 2, 3)]
        pool.release([r.key for r in refs], owner)
        assert counts(pool) == (0, 3, 6 * MiB)  # in their grace period
        again = put(pool, data(2 * MiB, 9), owner)
        assert again.key == refs[1].key  # reused, warm
        assert owner.told.wait(timeout=10)  # the grace is over: trimmed, unasked
        assert owner.closed == [refs[0].key]  # the oldest; the newest stays
        assert counts(pool) == (1, 1, 3 * MiB)
    finally:
        pool.close()


def test_close_closes_every_segment() -> None:
    pool = SegmentPool()
    idle = put(pool, data(MiB, 18), LINK)
    busy = put(pool, data(MiB, 19), LINK)
    pool.release([idle.key], owner=LINK)
    pool.close()
    assert counts(pool) == (0, 0, 0)
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
    first = put(pool, data(MiB, 30), LINK)
    released = Releases()
    view = mapper.view(first, released)
    del view
    assert released.keys == [first.key]
    pool.release(released.keys, owner=LINK)
    second = put(pool, data(MiB, 31), LINK)
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
    ref = put(pool, data(MiB, 20), LINK)
    size = os.fstat(fd_of(ref)).st_size
    released = Releases()
    with pytest.raises(RemoteProtocolError, match="does not hold"):
        SegmentMapper(os.getpid()).view(ExternalRef(ref.key, size + 1), released)
    gc.collect()
    assert released.keys == []  # nothing was mapped, so nothing is released


@pytest.mark.parametrize("nbytes", [0, -1])
def test_map_segment_rejects_empty_or_negative_refs(pool: SegmentPool, nbytes: int) -> None:
    ref = put(pool, data(MiB, 21), LINK)
    with pytest.raises(RemoteProtocolError, match="does not hold"):
        SegmentMapper(os.getpid()).view(ExternalRef(ref.key, nbytes), Releases())


def test_map_segment_of_a_missing_process() -> None:
    # pid_max is at most 2**22 on Linux, so this pid cannot exist.
    with pytest.raises(RemoteProtocolError, match="cannot open"):
        SegmentMapper(2**22 + 17).view(ExternalRef(3, 10), Releases())


# -- the probe: proof that a peer can map our segments ---------------------------------


def test_a_pools_probe_opens_and_maps_as_its_segments_would(pool: SegmentPool) -> None:
    key = pool.probe_key
    assert key is not None and key >> 32 >= 1 << 31  # a serial no count reaches
    assert shm.open_probe(os.getpid(), key) is None
    other = SegmentPool()
    assert other.probe_key != key  # random: each pool's is its own
    other.close()


def test_a_probe_of_another_serial_or_process_is_refused_saying_why(pool: SegmentPool) -> None:
    key = pool.probe_key
    assert key is not None
    wrong = shm.open_probe(os.getpid(), key ^ 1 << 32)
    assert wrong is not None and wrong.startswith("probe segment not mapped: ")
    assert wrong.endswith("is not an asyncrpc segment of that key")
    gone = shm.open_probe(2**22 + 17, key)  # pid_max is at most 2**22: no such process
    assert gone is not None and "cannot open" in gone


def test_a_descriptor_that_is_no_segment_is_never_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's word names the descriptor: only a memfd of the right name is opened."""
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda path, *args: opened.append(path) or real_open(path, *args)
    )
    read, write = os.pipe()
    try:
        why = shm.open_probe(os.getpid(), 5 << 32 | read)
    finally:
        os.close(read)
        os.close(write)
    assert why is not None and why.endswith("is not an asyncrpc segment of that key")
    assert opened == []


def test_a_closed_pools_probe_is_gone() -> None:
    pool = SegmentPool()
    key = pool.probe_key
    assert key is not None
    pool.close()
    assert shm.open_probe(os.getpid(), key) is not None


# -- the budget ---------------------------------------------------------------------------


def test_a_put_beyond_the_budget_signals_a_fallback_to_the_socket() -> None:
    pool = SegmentPool(budget=4 * MiB)
    try:
        first = put(pool, data(3 * MiB, 40), LINK)
        assert pool.put(memoryview(data(2 * MiB, 41)), LINK) is None  # 3 + 2 > 4
        assert pool.put(memoryview(data(8 * MiB, 42)), LINK) is None  # larger than it all
        stats = pool.stats
        assert stats["fallbacks"] == 2 and stats["fallback_bytes"] == 10 * MiB
        assert stats["bytes_in_use"] == 3 * MiB and stats["segments_in_use"] == 1
        assert SegmentMapper(os.getpid()).view(first, Releases())[:] == data(3 * MiB, 40)
    finally:
        pool.close()


def test_a_new_segment_makes_room_by_closing_idle_ones_and_tells_their_owners() -> None:
    pool = SegmentPool(budget=4 * MiB, max_idle_bytes=4 * MiB)
    owner = Owner("link")
    try:
        old = put(pool, data(3 * MiB, 43), owner)
        pool.release([old.key], owner)
        new = put(pool, data(2 * MiB, 44), owner)  # 3 MiB idle does not fit 2 MiB snugly
        assert new.key != old.key
        assert owner.closed == [old.key]  # its peer may drop its mapping
        with pytest.raises(RemoteProtocolError):  # closed (its fd number may be reused)
            SegmentMapper(os.getpid()).view(old, Releases())
        assert pool.stats["fallbacks"] == 0
        assert counts(pool) == (1, 0, 0)
    finally:
        pool.close()


def test_use_never_exceeds_the_budget_under_random_traffic() -> None:
    budget = 24 * MiB
    pool = SegmentPool(budget=budget, max_idle_bytes=6 * MiB)
    rng = random.Random(7)
    lent: list[int] = []
    try:
        for step in range(300):
            if lent and rng.random() < 0.45:
                pool.release([lent.pop(rng.randrange(len(lent)))], LINK)
            else:
                ref = pool.put(memoryview(bytes(rng.randint(MiB, 6 * MiB))), LINK)
                if ref is not None:
                    lent.append(ref.key)
            stats = pool.stats
            assert stats["bytes_in_use"] + stats["bytes_idle"] <= budget, step
        stats = pool.stats
        assert stats["peak_bytes"] <= budget
        assert stats["fallbacks"] > 0 and stats["segments_in_use"] == len(lent)
    finally:
        pool.close()


def test_default_budget_and_stats() -> None:
    pool = SegmentPool()
    try:
        put(pool, data(MiB, 45), LINK)
        put(pool, data(2 * MiB, 46), LINK)
        assert pool.stats == {
            "budget": DEFAULT_BUDGET,
            "max_idle_bytes": 256 * MiB,
            "bytes_in_use": 3 * MiB,
            "bytes_idle": 0,
            "peak_bytes": 3 * MiB,
            "segments_in_use": 2,
            "segments_idle": 0,
            "fallbacks": 0,
            "fallback_bytes": 0,
            "bytes_lent": 3 * MiB,
        }
    finally:
        pool.close()


# -- segment sizes and reuse --------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [MiB, MiB + 5, MiB + 100_000])
def test_capacity_rounds_up_to_64_kib_not_2_mib(pool: SegmentPool, nbytes: int) -> None:
    ref = put(pool, data(nbytes, 47), LINK)
    capacity = os.fstat(fd_of(ref)).st_size
    assert nbytes <= capacity < nbytes + GRANULE
    assert capacity < 1.25 * MiB
    assert pool.stats["bytes_in_use"] == capacity


def test_repeated_same_size_transfers_reuse_one_segment(pool: SegmentPool) -> None:
    keys = set()
    for i in range(10):
        ref = put(pool, data(4 * MiB, 48 + i), LINK)
        keys.add(ref.key)
        pool.release([ref.key], LINK)
    assert len(keys) == 1
    assert counts(pool) == (0, 1, 4 * MiB)


def test_reuse_takes_an_idle_segment_only_within_25_percent(pool: SegmentPool) -> None:
    idle = put(pool, data(2 * MiB, 60), LINK)
    pool.release([idle.key], LINK)
    too_small = put(pool, data(MiB, 61), LINK)  # 2 MiB would be twice what it needs
    assert too_small.key != idle.key
    snug = put(pool, data(2 * MiB - 300_000, 62), LINK)
    assert snug.key == idle.key


def test_lend_then_fill_in_another_thread(pool: SegmentPool) -> None:
    payload = data(5 * MiB, 63)
    segment = pool.lend(len(payload), LINK)
    assert segment is not None
    ref = segment.ref(len(payload))  # known before any byte is copied
    filler = threading.Thread(target=fill_all, args=([(segment, memoryview(payload))],))
    filler.start()
    filler.join(timeout=30)
    assert not filler.is_alive()
    assert SegmentMapper(os.getpid()).view(ref, Releases())[:] == payload


def test_a_lent_segment_closed_before_its_copy_is_never_mapped(pool: SegmentPool) -> None:
    """Its link was lost while a copier thread had the copy queued: the descriptor is
    closed (and its number may be reused), so the copy fails instead of mapping it."""
    owner = Owner("lost")
    segment = pool.lend(2 * MiB, owner)
    assert segment is not None and segment.mapping is None  # lending maps nothing
    pool.forget(owner)
    with pytest.raises(OSError):
        segment.fill(memoryview(data(2 * MiB, 71)))
    assert segment.mapping is None
    assert counts(pool) == (0, 0, 0)


def test_forget_tells_other_owners_of_the_segments_it_closes(pool: SegmentPool) -> None:
    """A segment lent to A, then to B: B's link is lost, so it closes; A's peer may
    still cache it, so A hears of it too (B, being gone, does not)."""
    a, b = Owner("a"), Owner("b")
    first = put(pool, data(MiB, 64), a)
    pool.release([first.key], a)
    again = put(pool, data(MiB, 65), b)
    assert again.key == first.key
    pool.forget(b)
    assert a.closed == [first.key] and b.closed == []


# -- the receiver's cache -------------------------------------------------------------------


def test_mapper_forgets_segments_the_sender_closed(pool: SegmentPool) -> None:
    mapper = SegmentMapper(os.getpid())
    refs = [put(pool, data(n * MiB, 66), LINK) for n in (1, 2)]
    views = [mapper.view(ref, Releases()) for ref in refs]
    assert mapper.cached_bytes == 3 * MiB
    mapper.forget([refs[0].key, 12345])
    assert mapper.cached_bytes == 2 * MiB
    assert views[0][:] == data(MiB, 66)  # a living view keeps its own mapping
    mapper.clear()
    assert mapper.cached_bytes == 0


def test_mapper_cache_is_bounded_and_keeps_the_newest(pool: SegmentPool) -> None:
    mapper = SegmentMapper(os.getpid(), max_cached_bytes=3 * MiB)
    for n in (1, 2, 2):
        ref = put(pool, data(n * MiB, 67), LINK)
        del ref  # the views die at once: only the cache holds mappings
        mapper.view(put(pool, data(n * MiB, 68), LINK), Releases())
    assert mapper.cached_bytes == 2 * MiB  # 1 + 2 fit, a second 2 MiB evicted both
    big = put(pool, data(5 * MiB, 69), LINK)
    mapper.view(big, Releases())
    assert mapper.cached_bytes == 5 * MiB  # over the bound, but the newest stays


def test_map_segment_rejects_a_key_with_another_serial(pool: SegmentPool) -> None:
    """The key's serial must be in the memfd's name: a descriptor number reused by a
    newer segment is not mistaken for the one the key named."""
    ref = put(pool, data(MiB, 70), LINK)
    stale = ExternalRef(ref.key + (1 << 32), ref.nbytes)
    with pytest.raises(RemoteProtocolError, match="not an asyncrpc segment"):
        SegmentMapper(os.getpid()).view(stale, Releases())


class Dropped:
    """Stands in for the housekeeper: what a mapper hands it to unmap."""

    def __init__(self) -> None:
        self.objects: list[Any] = []

    def drop(self, objects: list[Any]) -> None:
        self.objects.extend(objects)
        objects.clear()


@pytest.mark.parametrize("how", ["forget", "clear"])
def test_a_mapper_lets_go_of_the_mappings_it_is_told_to(
    pool: SegmentPool, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    dropped = Dropped()
    monkeypatch.setattr(shm, "housekeeper", dropped)
    mapper = SegmentMapper(os.getpid())
    kept, gone = put(pool, data(MiB, 50), LINK), put(pool, data(2 * MiB, 51), LINK)
    for ref, seed in ((kept, 50), (gone, 51)):
        assert mapper.view(ref, Releases())[:] == data(ref.nbytes, seed)
    assert mapper.cached_bytes == 3 * MiB and dropped.objects == []
    if how == "forget":
        mapper.forget([gone.key, 12345])  # an unknown key is ignored
        assert mapper.cached_bytes == MiB
        assert [m.nbytes for m in dropped.objects] == [2 * MiB]
        assert mapper.view(kept, Releases())[:] == data(MiB, 50)  # still cached
        assert [m.nbytes for m in dropped.objects] == [2 * MiB]
    else:
        mapper.clear()
        assert mapper.cached_bytes == 0
        assert sorted(m.nbytes for m in dropped.objects) == [MiB, 2 * MiB]


def test_a_copy_of_several_pieces_is_shared_and_arrives_whole(pool: SegmentPool) -> None:
    source = bytearray(data(3 * shm.COPY_PIECE + 12345, 7))  # four pieces, the last short
    ref = put(pool, source, LINK)
    assert isinstance(ref, ExternalRef)
    memory = SegmentMapper(os.getpid()).view(ref, Releases())
    assert memory[:] == source


def test_a_copy_into_fresh_pages_is_cut_finer_than_one_into_warm_pages(
    pool: SegmentPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faulting pages in costs more than copying into them: a copy into a new segment
    is shared in FRESH_PIECEs (each faulted in first), one of the same size into a
    reused segment is one memcpy (it fits a COPY_PIECE)."""
    pieces: list[tuple[int, int, bool]] = []
    copy_piece = shm._copy_piece

    def recorded(destination: Any, offset: int, address: int, nbytes: int, fresh: bool) -> None:
        pieces.append((offset, nbytes, fresh))
        copy_piece(destination, offset, address, nbytes, fresh)

    monkeypatch.setattr(shm, "_copy_piece", recorded)
    piece, size = shm.FRESH_PIECE, 2 * shm.FRESH_PIECE + 4096
    assert size <= shm.COPY_PIECE
    first = put(pool, bytearray(data(size, 3)), LINK)
    assert pieces == [(0, piece, True), (piece, piece, True), (2 * piece, 4096, True)]
    assert SegmentMapper(os.getpid()).view(first, Releases())[:] == data(size, 3)
    pool.release([first.key], owner=LINK)
    pieces.clear()
    second = put(pool, bytearray(data(size, 4)), LINK)
    assert second.key == first.key and pieces == []  # reused, and copied in one go
    assert SegmentMapper(os.getpid()).view(second, Releases())[:] == data(size, 4)
