"""The agent's thread pool: jobs run, threads start only when needed, shutdown stops them."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from asyncrpc.agent.pool import WorkerPool


class ObservedLock:
    """Stands in for a pool's lock and wakes whoever waits for the pool's state to
    change: every release notifies, so a test waits on the condition itself."""

    def __init__(self) -> None:
        self._changed = threading.Condition()

    def __enter__(self) -> None:
        self._changed.acquire()

    def __exit__(self, *exc: object) -> None:
        self._changed.notify_all()
        self._changed.release()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout)


def observed_pool(max_threads: int) -> tuple[WorkerPool, ObservedLock]:
    pool = WorkerPool(max_threads, "test")
    lock = pool._lock = ObservedLock()  # type: ignore[assignment]
    return pool, lock


def test_jobs_run_and_idle_threads_are_reused() -> None:
    """A job submitted while a thread is idle runs on it: no new thread.  (A job's own
    completion signal fires before its thread counts itself idle again, so the test
    waits for the thread to be idle, not just for the job to be done.)"""
    pool, lock = observed_pool(4)
    for _ in range(20):
        done = threading.Event()
        pool.submit(done.set)
        assert done.wait(5)
        assert lock.wait_for(lambda: len(pool._idle) == 1, 5), "the thread never went idle"
    assert len(pool._threads) == 1
    pool.shutdown()


def test_a_job_submitted_while_every_thread_is_busy_starts_a_thread() -> None:
    """The other side of reuse: no idle thread, a new one (up to the limit)."""
    pool, lock = observed_pool(4)
    gate = threading.Event()
    pool.submit(gate.wait, 5)  # holds the only thread until the next job runs
    pool.submit(gate.set)
    assert gate.wait(5), "the second job ran beside the first"
    assert len(pool._threads) == 2
    assert lock.wait_for(lambda: len(pool._idle) == 2, 5), "both jobs finish, both threads idle"
    pool.shutdown()


def blocked_jobs(pool: WorkerPool, submitted: int) -> tuple[threading.Event, threading.Semaphore]:
    """Submit ``submitted`` jobs that each block until the gate returned is set; the
    semaphore is released as each one starts."""
    gate, started = threading.Event(), threading.Semaphore(0)

    def blocked() -> None:
        started.release()
        gate.wait(5)

    for _ in range(submitted):
        pool.submit(blocked)
    return gate, started


def test_blocked_threads_make_the_pool_grow_up_to_its_limit() -> None:
    pool = WorkerPool(3, "test")
    gate, started = blocked_jobs(pool, 5)
    for _ in range(3):
        assert started.acquire(timeout=5)
    assert len(pool._threads) == 3  # the limit, though five jobs were submitted
    assert not started.acquire(timeout=0.05)  # the other two wait for a free thread
    gate.set()
    for _ in range(2):
        assert started.acquire(timeout=5)
    pool.shutdown()


def test_a_failing_job_does_not_kill_its_thread(caplog: pytest.LogCaptureFixture) -> None:
    pool = WorkerPool(1, "test")
    ran = threading.Event()

    def fail() -> None:
        raise ValueError("job failure")

    pool.submit(fail)
    pool.submit(ran.set)
    assert ran.wait(5)
    assert "job failure" in caplog.text
    pool.shutdown()


def test_shutdown_stops_threads_and_refuses_new_jobs() -> None:
    pool = WorkerPool(2, "test")
    ran = threading.Event()
    pool.submit(ran.set)
    assert ran.wait(5)
    pool.shutdown()
    for thread in pool._threads:
        thread.join(5)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(ran.set)


def test_threads_busy_at_shutdown_stop_once_their_job_ends() -> None:
    pool = WorkerPool(3, "test")
    gate, started = blocked_jobs(pool, 3)
    for _ in range(3):
        assert started.acquire(timeout=5)
    pool.submit(print)  # queued behind them: dropped by the shutdown
    pool.shutdown()
    gate.set()
    for thread in pool._threads:
        thread.join(5)
        assert not thread.is_alive()


def test_a_finished_job_keeps_nothing_alive() -> None:
    """Arguments (e.g. received tensors holding shared memory) die with their job,
    not when the next job happens to arrive."""
    import weakref

    class Payload:
        pass

    pool = WorkerPool(1, "test")
    payload = Payload()
    freed = threading.Event()
    alive = weakref.ref(payload, lambda _: freed.set())
    pool.submit(lambda p: None, payload)
    del payload
    assert freed.wait(5), "the worker still holds the finished job's arguments"
    assert alive() is None
    pool.shutdown()


def test_calls_one_at_a_time_run_on_the_thread_that_finished_last() -> None:
    """Last in, first out: with several threads idle, a worker whose calls come one at a
    time runs them all on one thread (a queue would hand them to each thread in turn)."""
    pool, lock = observed_pool(4)
    gate, started = blocked_jobs(pool, 3)
    for _ in range(3):
        assert started.acquire(timeout=5)
    gate.set()
    assert lock.wait_for(lambda: len(pool._idle) == 3, 5), "the three threads go idle"
    ran_on: list[int] = []
    for _ in range(10):
        done = threading.Event()
        pool.submit(lambda: (ran_on.append(threading.get_ident()), done.set()))
        assert done.wait(5)
        assert lock.wait_for(lambda: len(pool._idle) == 3, 5)
    assert len(set(ran_on)) == 1
    assert len(pool._threads) == 3
    pool.shutdown()


def test_a_thread_the_system_refuses_leaves_the_job_to_a_busy_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool = WorkerPool(4, "test")
    gate, started, second = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        started.set()
        gate.wait(5)

    pool.submit(first)
    assert started.wait(5)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    pool.submit(second.set)  # no thread to wake, none can start: it waits, no error
    assert "cannot start a thread" in caplog.text
    gate.set()
    assert second.wait(5), "the busy thread took it once free"
    assert len(pool._threads) == 1
    monkeypatch.undo()
    pool.shutdown()
