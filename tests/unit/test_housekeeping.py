"""Unit tests for the shared-memory background threads (Copiers, the housekeeper)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

from asyncrpc.transport.housekeeping import Copiers, housekeeper


@pytest.fixture
def copiers() -> Iterator[Copiers]:
    workers = Copiers(1, "test-copier")
    yield workers
    workers.shutdown()


def test_jobs_run_on_the_copier_threads_in_order(copiers: Copiers) -> None:
    ran: list[tuple[int, str]] = []
    futures = [
        copiers.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
        for i in range(5)
    ]
    for future in futures:
        assert future.result(timeout=10) is None
    assert [i for i, _ in ran] == list(range(5))
    assert all(name.startswith("test-copier") for _, name in ran)


class Payload:
    """Stands for the buffers a copy job holds."""


def test_a_failed_job_leaves_no_reference_cycle(copiers: Copiers) -> None:
    """Its future, error and payload are freed by reference counting: Python 3.11's
    collector can crash breaking a cycle that holds a memoryview (gh-77894)."""
    payload = Payload()

    def fail(held: Payload = payload) -> None:
        raise OSError(12, "no memory")

    gc.disable()
    try:
        future = copiers.submit(fail)
        error = future.exception(timeout=10)
        assert isinstance(error, OSError)
        copiers.submit(lambda: None).result(timeout=10)  # the failed job's frame is gone
        future_ref, payload_ref = weakref.ref(future), weakref.ref(payload)
        del future, error, fail, payload
        assert future_ref() is None
        assert payload_ref() is None
    finally:
        gc.enable()


def test_the_housekeeper_runs_chores_when_due_and_drops_what_it_is_given() -> None:
    done = threading.Event()
    when = time.monotonic() + 0.05
    housekeeper.call_at(when, done.set)
    assert done.wait(timeout=10)
    assert time.monotonic() >= when

    dropped_on: list[str] = []

    class Held:
        def __del__(self) -> None:
            dropped_on.append(threading.current_thread().name)

    given = [Held()]
    housekeeper.drop(given)
    assert given == []  # the caller's references are gone at once
    flushed = threading.Event()
    housekeeper.call_at(time.monotonic(), flushed.set)  # queued after the drop
    assert flushed.wait(timeout=10)
    assert dropped_on == ["asyncrpc-housekeeping"]


def test_share_runs_every_piece_once_here_and_on_free_copiers() -> None:
    copiers = Copiers(2, "test-share")
    try:
        ran: list[tuple[int, str]] = []
        lock = threading.Lock()
        gate = threading.Barrier(3, timeout=10)  # three threads, each in a piece at once

        def piece(i: int) -> None:
            if i < 3:
                gate.wait()
            with lock:
                ran.append((i, threading.current_thread().name))

        copiers.share([lambda i=i: piece(i) for i in range(12)])
        assert sorted(i for i, _ in ran) == list(range(12))  # each once, all before return
        names = {name for _, name in ran}
        assert threading.current_thread().name in names
        assert sum(name.startswith("test-share") for name in names) == 2
    finally:
        copiers.shutdown()


def test_share_raises_the_first_error_once_every_piece_has_run(copiers: Copiers) -> None:
    ran: list[int] = []

    def piece(i: int) -> None:
        ran.append(i)
        if i in (2, 5):
            raise OSError(i, "copy failed")

    with pytest.raises(OSError) as caught:
        copiers.share([lambda i=i: piece(i) for i in range(8)])
    assert caught.value.errno in (2, 5)
    assert sorted(ran) == list(range(8))


def test_a_copier_may_share_its_own_job_without_deadlock(copiers: Copiers) -> None:
    """Every copier busy sharing: the pieces they hand out are taken by themselves."""
    ran: list[int] = []
    job = copiers.submit(lambda: copiers.share([lambda i=i: ran.append(i) for i in range(6)]))
    assert job.result(timeout=10) is None
    assert sorted(ran) == list(range(6))
