"""The worker's thread pool for plain functions: a job queue, threads started on demand,
woken one at a time, the one that went idle last first.

Theory of operation
-------------------
``concurrent.futures.ThreadPoolExecutor`` builds a Future and a work item for
every job and takes locks and a semaphore to submit it: loop time on every
call for a Future the agent never uses (replies return through its own
completion queue; docs/architecture.md has the figures).  This pool is only
what the agent needs: ``submit`` appends ``(function, args)`` to a queue and
wakes one thread for it, unless a thread already woken has yet to take a job.
A thread takes jobs until the queue is empty, and wakes the next one whenever it
takes a job and leaves others queued; then it sleeps on a lock of its own.  So:

* **The thread woken is the one that went idle last** (a stack), not the one
  that waited longest (a shared queue's waiters take turns).  A worker whose
  calls come one at a time runs them all on one thread, which the kernel keeps
  where it last ran: after a burst had grown the pool to 16 threads, a plain
  no-op round trip took 74-87 µs with the threads taking turns and 54-56 µs
  this way (fresh pairs, alternating).
* **One wake-up at a time.**  A burst of quick jobs runs on the few threads that
  keep up with it, each taking job after job in its time slice, and starts more
  only while jobs are left when one is taken: 256 no-ops at once grew the pool
  to 2-3 threads, not 16.  Slow or blocking jobs still each get a thread, up to
  ``max_threads`` (each one taken wakes the next thread before it runs).

The first thread starts with the pool: starting a thread waits until it runs,
and a process's first call paid for that (0.5-1 ms of its 2.6 ms on this VM).
Threads are daemons, so a function that never returns cannot hold up
interpreter exit; ``shutdown`` lets the others finish their current job and stop.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

Job = tuple[Callable[..., Any], tuple[Any, ...]]
log = logging.getLogger("asyncrpc.agent")


class _Thread:
    """One pool thread's own lock, which it sleeps on while idle."""

    __slots__ = ("stop", "wake")

    def __init__(self) -> None:
        self.stop = False
        self.wake = threading.Lock()
        self.wake.acquire()  # held until the thread is woken


class WorkerPool:
    """Runs submitted jobs on up to ``max_threads`` threads, in submission order."""

    def __init__(self, max_threads: int, name: str) -> None:
        if max_threads < 1:
            raise ValueError(f"a thread pool needs at least one thread, not {max_threads}")
        self.max_threads = max_threads
        self.name = name
        self._lock = threading.Lock()
        self._jobs: deque[Job] = deque()
        self._idle: list[_Thread] = []  # sleeping; the one that finished last at the end
        self._waking = False  # a thread woken (or started) has not yet taken a job
        self._threads: list[threading.Thread] = []
        self._closed = False
        with self._lock:
            self._idle.append(self._start_thread(waking=False))

    def submit(self, function: Callable[..., Any], *args: Any) -> None:
        """Queue ``function(*args)``; it runs on a pool thread (exceptions are its own)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"thread pool {self.name} is shut down")
            self._jobs.append((function, args))
            self._wake_one()

    @property
    def stats(self) -> dict[str, int]:
        """Threads started, busy with a job, and jobs queued for a free thread."""
        with self._lock:
            threads, idle, queued = len(self._threads), len(self._idle), len(self._jobs)
        return {"threads": threads, "busy": threads - idle, "queued": queued}

    def shutdown(self) -> None:
        """Stop every thread once it has finished its current job; queued jobs are dropped."""
        with self._lock:
            self._closed = True
            self._jobs.clear()
            idle, self._idle = self._idle, []
        for thread in idle:
            thread.stop = True
            thread.wake.release()

    def _wake_one(self) -> None:
        """With the lock held and jobs queued: wake the idle thread that finished last, or
        start one, unless a thread already on its way will take them (it wakes the next
        one if more are left: one wake-up at a time, so a burst of quick jobs runs on the
        few threads that keep up with it, in one thread's time slice where it can).  A
        thread the system refuses to start is logged; the jobs wait for a busy one, as
        they do once ``max_threads`` run."""
        if self._waking:
            return
        if self._idle:
            self._idle.pop().wake.release()
        elif len(self._threads) < self.max_threads:
            try:
                self._start_thread(waking=True)
            except RuntimeError:  # "can't start new thread": out of threads or memory
                log.warning("thread pool %s cannot start a thread", self.name, exc_info=True)
                return
        else:
            return
        self._waking = True

    def _start_thread(self, *, waking: bool) -> _Thread:
        me = _Thread()
        thread = threading.Thread(
            target=self._work,
            args=(me, waking),
            name=f"{self.name}-{len(self._threads)}",
            daemon=True,
        )
        thread.start()
        self._threads.append(thread)
        return me

    def _work(self, me: _Thread, waking: bool) -> None:
        woken = waking or me.wake.acquire()  # (a thread started idle sleeps first)
        while not me.stop:
            job = self._next(me, woken)
            if job is None:  # idle, or told to stop (the pool shut down)
                woken = not me.stop and me.wake.acquire()
                continue
            woken = False
            self._run(*job)
            del job  # a finished job's arguments must not live on until the next job

    def _next(self, me: _Thread, woken: bool) -> Job | None:
        """The next job for thread ``me``; None once it is idle, or told to stop."""
        with self._lock:
            if woken:
                self._waking = False
            if self._jobs:
                job = self._jobs.popleft()
                if self._jobs:
                    self._wake_one()  # more than this thread's: the next one comes
                return job
            if self._closed:
                me.stop = True
            else:
                self._idle.append(me)
            return None

    def _run(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            function(*args)
        except BaseException:  # a job's own errors are its business; keep serving
            log.exception("job %r failed on thread pool %s", function, self.name)
