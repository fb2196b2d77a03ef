"""The worker's thread pool for plain functions: a job queue and lazily started threads.

Theory of operation
-------------------
``concurrent.futures.ThreadPoolExecutor`` builds a Future and a work item for
every job and takes locks and a semaphore to submit it: loop time on every
call for a Future the agent never uses (replies return through its own
completion queue; docs/architecture.md has the figures).  This pool is only
what the agent needs: ``submit`` puts ``(function, args)`` on a ``SimpleQueue``,
and threads start on demand, up to ``max_threads``, when none is idle.  The
first starts with the pool: starting a thread waits until it runs, and a
process's first call paid for that (0.5-1 ms of its 2.6 ms on this VM).  Threads
are daemons, so a function that never returns cannot hold up interpreter exit;
``shutdown`` lets the others finish their current job and stop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = None
log = logging.getLogger("asyncrpc.agent")


class WorkerPool:
    """Runs submitted jobs on up to ``max_threads`` threads, in submission order."""

    def __init__(self, max_threads: int, name: str) -> None:
        if max_threads < 1:
            raise ValueError(f"a thread pool needs at least one thread, not {max_threads}")
        self.max_threads = max_threads
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        with self._lock:
            self._start_thread()

    def submit(self, function: Callable[..., Any], *args: Any) -> None:
        """Queue ``function(*args)``; it runs on a pool thread (exceptions are its own)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"thread pool {self.name} is shut down")
            # _idle counts waiting threads minus queued jobs: <= 0 means no thread is free.
            if self._idle <= 0 and len(self._threads) < self.max_threads:
                self._start_thread()
            self._idle -= 1
        self._jobs.put((function, args))

    @property
    def stats(self) -> dict[str, int]:
        """Threads started, busy with a job, and jobs queued for a free thread."""
        with self._lock:
            threads, idle = len(self._threads), self._idle
        return {"threads": threads, "busy": threads - max(idle, 0), "queued": max(-idle, 0)}

    def shutdown(self) -> None:
        """Stop every thread once it has finished its current job; queued jobs are dropped."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        for _ in range(threads):
            self._jobs.put(_STOP)

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        self._idle += 1
        thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            self._run(*job)
            del job  # a finished job's arguments must not live on until the next job
            with self._lock:
                self._idle += 1

    def _run(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            function(*args)
        except BaseException:  # a job's own errors are its business; keep serving
            log.exception("job %r failed on thread pool %s", function, self.name)
