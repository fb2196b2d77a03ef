"""The agent's thread pool: jobs run, threads start only when needed, shutdown stops them."""

from __future__ import annotations

import threading

import pytest

from asyncrpc.agent.pool import WorkerPool


def test_jobs_run_and_idle_threads_are_reused() -> None:
    pool = WorkerPool(4, "test")
    done = [threading.Event() for _ in range(20)]
    for event in done:
        pool.submit(event.set)
        assert event.wait(5)  # one at a time: the single idle thread takes each
    assert len(pool._threads) == 1
    pool.shutdown()


def test_blocked_threads_make_the_pool_grow_up_to_its_limit() -> None:
    pool = WorkerPool(3, "test")
    gate, started = threading.Event(), threading.Semaphore(0)

    def blocked() -> None:
        started.release()
        gate.wait(5)

    for _ in range(5):
        pool.submit(blocked)
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
