"""Background threads for the shared-memory work no event loop should do.

Theory of operation
-------------------
:class:`Copiers` are a segment pool's threads that fill segments: started with
the pool, fed through a queue.  (``ThreadPoolExecutor`` starts its threads on
the first submits, and starting a thread waits until it runs, on the event loop
that submitted.)  A job's references go when it ends, so a tensor being copied
lives no longer than its copy.  One large copy is cut in pieces that the thread
that wants it done and the idle copiers take in turn (``share``): page faults
and copies of a fresh segment run on every core (docs/architecture.md, "Copies
off the loop").  The asking thread never waits for a piece nobody has taken, so
a copier may share its own job without deadlock.

Giving shared memory back is slow: the last unmap of a segment frees its pages
(docs/architecture.md, "Copies off the loop", has the measurements).  So
the objects that hold mappings are handed to :data:`housekeeper`, whose thread
drops them (``drop`` empties the list it is given, so the caller's references
are gone and the thread's are the last; a reference held elsewhere, such as a
tensor on a view, just makes the unmap happen later, where that one dies).

The housekeeping thread (one per process, started on first use) also runs
timed chores (``call_at``): a pool trims idle memory it has kept past its grace
period, whether or not anything else happens by then.  Both pools that keep
memory warm for reuse (the segment pool's idle segments, the receive storage's
idle mappings) keep it in an :class:`IdleCache`, which holds the one rule for
what is reused and what is dropped, and ask for their chores with
:func:`schedule_trim`.  A chore that
raises is logged; the thread carries on.  All these threads are daemons: at
exit the kernel takes the mappings back anyway.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger("asyncrpc.transport")
Chore = tuple[float, int, Callable[[], None]]


class Housekeeper:
    """See the module docstring."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Any] | Chore] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._order = itertools.count()

    def drop(self, objects: list[Any]) -> None:
        """Let go of ``objects`` on the housekeeping thread; empties the list."""
        if objects:
            self._put(objects[:])
            objects.clear()

    def call_at(self, when: float, chore: Callable[[], None]) -> None:
        """Run ``chore()`` on the housekeeping thread at ``time.monotonic()`` ``when``."""
        self._put((when, next(self._order), chore))

    def _put(self, item: list[Any] | Chore) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(
                    target=self._run, name="asyncrpc-housekeeping", daemon=True
                ).start()
        self._queue.put(item)

    def _run(self) -> None:
        chores: list[Chore] = []
        while True:
            self._wait(chores)
            while chores and chores[0][0] <= time.monotonic():
                _run_chore(heapq.heappop(chores)[2])

    def _wait(self, chores: list[Chore]) -> None:
        """Until the next chore is due or something arrives (dropped at once)."""
        timeout = max(0.0, chores[0][0] - time.monotonic()) if chores else None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return
        if isinstance(item, tuple):
            heapq.heappush(chores, item)
        # a list of objects to drop goes with this frame


class Copiers:
    """``threads`` threads running jobs in submission order, started right away."""

    def __init__(self, threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[None], Callable[[], None]] | None]
        self._jobs = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], None]) -> Future[None]:
        """Run ``job()`` on one of the threads; a future of its outcome."""
        future: Future[None] = Future()
        self._jobs.put((future, job))
        return future

    def share(self, pieces: list[Callable[[], object]]) -> None:
        """Run every piece, here and on the copier threads that are free, and return
        when all have run; raises the first piece's error after that."""
        work = _SharedWork(pieces)
        for _ in range(min(len(self._threads), len(pieces) - 1)):
            self.submit(work.help)
        work.help()
        work.wait()

    def shutdown(self) -> None:
        """Let each thread finish the jobs before this and end (without waiting)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        while _run_job(self._jobs.get()):
            pass


class _SharedWork:
    """Pieces any thread may take, one at a time, until none is left."""

    def __init__(self, pieces: list[Callable[[], object]]) -> None:
        self._pieces = pieces[::-1]  # taken from the end: in order
        self._running = 0
        self._error: BaseException | None = None
        self._done = threading.Condition()

    def help(self) -> None:
        """Take and run pieces until none is left to take."""
        while True:
            with self._done:
                if not self._pieces:
                    return
                piece = self._pieces.pop()
                self._running += 1
            error = _call(piece)
            del piece
            with self._done:
                self._running -= 1
                if error is not None and self._error is None:
                    self._error = error
                self._done.notify_all()
            del error

    def wait(self) -> None:
        """Until every piece taken has run; then raise the first error, if any."""
        with self._done:
            while self._running:
                self._done.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error


def _run_job(item: tuple[Future[None], Callable[[], None]] | None) -> bool:
    """Run one job (False: the end); its references die with this frame."""
    if item is None:
        return False
    future, job = item
    del item
    if future.set_running_or_notify_cancel():
        error = _call(job)
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
            # The traceback reaches this frame (through its callee's f_back): holding the
            # future here would make a reference cycle, and the garbage collector of
            # Python 3.11 can crash breaking one that holds a memoryview a tensor was
            # made from (gh-77894), as a failed copy's frames do.
            del error, future
    return True


def _call(job: Callable[[], object]) -> BaseException | None:
    """``job()``, and what it raised."""
    try:
        job()
    except BaseException as exc:
        return exc
    return None


def _run_chore(chore: Callable[[], None]) -> None:
    try:
        chore()
    except Exception:
        log.exception("shared-memory housekeeping chore failed")


housekeeper = Housekeeper()

M = TypeVar("M")


class IdleCache(Generic[M]):
    """Memory kept warm for reuse, least recently returned first, and the rule that
    bounds it: beyond ``max_idle_bytes``, what has been idle for ``idle_grace`` goes,
    oldest first, never the newest (a repeated transfer keeps its warm memory).  A
    buffer is reused for a request it holds with at most 25% to spare.  Not locked:
    its pool's lock guards it, and the pool disposes of what it drops."""

    def __init__(self, max_idle_bytes: int, idle_grace: float, size: Callable[[M], int]) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_grace = idle_grace
        self._size = size
        self._entries: list[tuple[M, float]] = []  # (buffer, when it was returned)
        self.bytes = 0
        self._trim_due = False  # a housekeeping chore will trim

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def buffers(self) -> list[M]:
        return [buffer for buffer, _ in self._entries]

    def add(self, buffer: M, now: float) -> None:
        self._entries.append((buffer, now))
        self.bytes += self._size(buffer)

    def take(self, nbytes: int) -> M | None:
        """The smallest idle buffer that holds ``nbytes`` with at most 25% to spare
        (ties: the warmest), or None."""
        size = self._size
        fits = [i for i, (b, _) in enumerate(self._entries) if nbytes <= size(b) <= nbytes * 5 // 4]
        if not fits:
            return None
        best = min(reversed(fits), key=lambda i: size(self._entries[i][0]))
        return self._pop(best)

    def pop_oldest(self) -> M:
        return self._pop(0)

    def clear(self) -> list[M]:
        """Forget every idle buffer; they are returned for disposal."""
        buffers = self.buffers
        self._entries, self.bytes = [], 0
        return buffers

    def expired(self, now: float) -> tuple[list[M], float | None]:
        """Take out the buffers the rule drops now; and when to look again (None: no
        need, or a chore is due already)."""
        dropped: list[M] = []
        while self.bytes > self.max_idle_bytes and len(self._entries) > 1:
            since = self._entries[0][1]
            if since > now - self.idle_grace:
                if self._trim_due:
                    return dropped, None
                self._trim_due = True
                return dropped, since + self.idle_grace
            dropped.append(self.pop_oldest())
        return dropped, None

    def chore_ran(self) -> None:
        """The scheduled trim is running: a later one may be scheduled."""
        self._trim_due = False

    def _pop(self, index: int) -> M:
        buffer = self._entries.pop(index)[0]
        self.bytes -= self._size(buffer)
        return buffer


class Trimmable(Protocol):
    def trim(self) -> None:
        """Drop what the pool's IdleCache says is due."""


def schedule_trim(pool: Trimmable, when: float | None) -> None:
    """Have the housekeeping thread call ``pool.trim()`` at ``when`` (monotonic; None:
    nothing to do), unless the pool is gone by then (a chore does not keep it alive)."""
    if when is not None:
        ref = weakref.ref(pool)
        housekeeper.call_at(when, lambda: _trim_if_alive(ref))


def _trim_if_alive(ref: weakref.ref[Trimmable]) -> None:
    alive = ref()
    if alive is not None:
        alive.trim()
