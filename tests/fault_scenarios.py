"""What the workers of fault-injection jobs do (see tests/cluster.py and test_faults.py).

Run as ``run_job("fault_scenarios.NAME", world)``: peers SIGKILLed or SIGSTOPped
in the middle of tensor calls, a worker leaving under load, a caller whose loop
is blocked while its server shuts down, remote code raising KeyboardInterrupt
or SystemExit.  Remote functions live here at module level so they travel by
reference.  Each scenario returns plain observations (counts, error types and
messages); the tests make the assertions.  Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import async_execution
from tests.scenarios import Config, echo, sleep_for, whoami

KIB, MIB = 1 << 10, 1 << 20
SMALL, LARGE = 64 * KIB, 2 * MIB  # inline in the frame; through shared memory (>= 1 MiB)


def tensor(nbytes: int, mark: float) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` bytes whose first element is ``mark``."""
    t = torch.ones(nbytes // 4)
    t[0] = mark
    return t


def mixed(i: int) -> torch.Tensor:
    """The i-th argument of a tensor workload: small and large tensors in turn."""
    return tensor(LARGE if i % 2 else SMALL, float(i))


# -- remote functions ---------------------------------------------------------------


def getpid() -> int:
    return os.getpid()


def first(x: torch.Tensor) -> float:
    return float(x[0])


async def hold(x: torch.Tensor, seconds: float) -> float:
    """Keep a tensor argument for a while on the callee's loop, then answer."""
    await asyncio.sleep(seconds)
    return float(x[0])


_events: dict[str, asyncio.Event] = {}
_served = Counter[str]()


def _event(name: str) -> asyncio.Event:
    """A named event of this process, made on first use (on the running loop)."""
    return _events.setdefault(name, asyncio.Event())


async def echo_counted(x: torch.Tensor, caller: str, leave_after: int) -> torch.Tensor:
    """Echo, and tell this worker's scenario to leave once ``leave_after`` calls came
    from each of the two callers."""
    _served[caller] += 1
    if len(_served) == 2 and min(_served.values()) >= leave_after:
        _event("leave").set()
    return x


async def request_shutdown() -> str:
    _event("shutdown").set()
    return asyncrpc.get_worker_info().name


_RAISED: dict[str, type[BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": SystemExit,
}


def raise_in_thread(kind: str) -> None:
    """A plain function (the callee's thread pool) raising ``kind``."""
    raise _RAISED[kind]("raised on purpose by remote code")


async def raise_on_loop(kind: str) -> None:
    """An ``async def`` (the callee's event loop) raising ``kind`` after one await."""
    await asyncio.sleep(0)
    raise _RAISED[kind]("raised on purpose by remote code")


@async_execution
def raise_via_async_execution(kind: str) -> Any:
    """An ``@async_execution`` function whose coroutine raises ``kind``."""
    return raise_on_loop(kind)


# -- helpers --------------------------------------------------------------------------


def error_record(exc: BaseException) -> dict[str, Any]:
    """What the tests look at in an error: its type, ancestry and message."""
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "exception": isinstance(exc, Exception),
        "connection": isinstance(exc, ConnectionError),
        "timeout": isinstance(exc, TimeoutError),
    }


@dataclass
class Tally:
    """Outcomes of a set of calls: every call issued must end exactly once."""

    peer: str
    issued: int = 0
    completed: int = 0
    wrong_values: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    not_naming_peer: list[str] = field(default_factory=list)
    pending: set[asyncio.Future[Any]] = field(default_factory=set)
    last_done: float = 0.0

    def track(self, future: asyncio.Future[Any], expect: Any = None) -> asyncio.Future[Any]:
        self.issued += 1
        self.pending.add(future)
        future.add_done_callback(lambda f: self._done(f, expect))
        return future

    def _done(self, future: asyncio.Future[Any], expect: Any) -> None:
        self.pending.discard(future)
        self.last_done = time.monotonic()
        if future.cancelled():
            self.failed["CancelledError"] += 1
            return
        exc = future.exception()
        if exc is None:
            self.completed += 1
            self.wrong_values += expect is not None and _value(future.result()) != expect
            return
        self.failed[type(exc).__name__] += 1
        if repr(self.peer) not in str(exc) and len(self.not_naming_peer) < 5:
            self.not_naming_peer.append(f"{type(exc).__name__}: {exc}")

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    async def settle(self, limit: float) -> None:
        """Wait (at most ``limit`` seconds) until every call tracked has ended."""
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=limit)

    def report(self) -> dict[str, Any]:
        return {
            "issued": self.issued,
            "completed": self.completed,
            "failures": self.failures,
            "failed": dict(self.failed),
            "unfinished": len(self.pending),
            "wrong_values": self.wrong_values,
            "not_naming_peer": self.not_naming_peer,
        }


def _value(result: Any) -> Any:
    return float(result[0]) if isinstance(result, torch.Tensor) else result


async def pipeline(
    window: int, issue: Callable[[int], asyncio.Future[Any]], stop: Callable[[], bool]
) -> int:
    """Keep ``window`` calls in flight (``issue(i)`` starts call i) until ``stop()``
    holds once a slot frees; returns how many calls were started."""
    slots = asyncio.Semaphore(window)
    started = 0
    while True:
        await slots.acquire()
        if stop():
            return started
        issue(started).add_done_callback(lambda _: slots.release())
        started += 1


# -- a: a peer SIGKILLed during tensor calls ------------------------------------------


async def killed_during_tensor_calls(cfg: Config) -> dict[str, Any]:
    """w0 keeps 100 tensor calls in flight to w1 and SIGKILLs it; then calls the dead
    w1 a few hundred times more with tensors, catching the errors, collecting garbage."""
    await cfg.join(rpc_timeout=60)
    if cfg.rank == 1:
        await asyncio.sleep(120)  # SIGKILLed long before
        return {}
    pid = await asyncrpc.rpc_async("w1", getpid)
    held = Tally("w1")
    for i in range(10):  # certainly in flight when the kill comes
        held.track(asyncrpc.rpc_async("w1", hold, args=(mixed(i), 60.0)))
    echoed = Tally("w1")

    def issue(i: int) -> asyncio.Future[Any]:
        x = mixed(i)
        return echoed.track(asyncrpc.rpc_async("w1", echo, args=(x,)), float(x[0]))

    await pipeline(100, issue, lambda: echoed.completed >= 300)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    in_flight = len(echoed.pending) + len(held.pending)
    await echoed.settle(30)
    await held.settle(30)
    seen: dict[str, Any] = {
        "in_flight_at_kill": in_flight,
        "echoed": echoed.report(),
        "held": held.report(),
        "settled_after_kill_s": max(echoed.last_done, held.last_done) - killed,
    }
    seen["afterwards"] = await _keep_calling_the_dead("w1", 300)
    seen["pending_after"] = asyncrpc.get_debug_info()["pending_outgoing_calls"]
    await asyncrpc.shutdown(timeout=20)
    return seen


async def _keep_calling_the_dead(peer: str, calls: int) -> dict[str, Any]:
    """Call a dead peer with tensors, catching what it raises (half one at a time,
    keeping the last error, as a retry loop would; half in concurrent batches)."""
    failed: Counter[str] = Counter()
    not_naming: list[str] = []
    last_error: BaseException | None = None
    collections = 0
    for i in range(calls // 2):
        try:
            await asyncrpc.rpc_async(peer, first, args=(mixed(i),))
        except Exception as exc:
            last_error = exc
            failed[type(exc).__name__] += 1
        if i % 25 == 0:
            gc.collect()
            collections += 1
    for batch in range(calls // 20):
        futures = [asyncrpc.rpc_async(peer, echo, args=(mixed(i),)) for i in range(10)]
        for outcome in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(outcome, BaseException):
                failed[type(outcome).__name__] += 1
                if repr(peer) not in str(outcome):
                    not_naming.append(str(outcome))
        if batch % 3 == 0:
            gc.collect()
            collections += 1
    gc.collect()
    return {
        "calls": calls,
        "failed": dict(failed),
        "not_naming_peer": not_naming[:5],
        "last_error": error_record(last_error) if last_error else None,
        "gc_collections": collections + 1,
    }


# -- b: a peer SIGSTOPped during tensor calls -----------------------------------------


async def stopped_during_tensor_calls(cfg: Config) -> dict[str, Any]:
    """w0 SIGSTOPs w1 with tensor calls in flight: calls with a short timeout time out;
    after SIGCONT, w1 serves new calls."""
    await cfg.join(rpc_timeout=60)
    if cfg.rank == 1:
        await asyncrpc.shutdown()  # serves until w0 is done
        return {}
    pid = await asyncrpc.rpc_async("w1", getpid)
    warm = [await asyncrpc.rpc_async("w1", first, args=(mixed(i),)) for i in range(4)]
    timeout = 1.5
    during, stopped = Tally("w1"), Tally("w1")
    try:
        for i in range(20):
            during.track(asyncrpc.rpc_async("w1", first, args=(mixed(i),), timeout=timeout))
        os.kill(pid, signal.SIGSTOP)
        issued = time.monotonic()
        for i in range(20):
            stopped.track(asyncrpc.rpc_async("w1", echo, args=(mixed(i),), timeout=timeout))
        await during.settle(30)
        await stopped.settle(30)
        timed_out_after = stopped.last_done - issued
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = Tally("w1")
    for i in range(20):
        x = mixed(i)
        resumed.track(asyncrpc.rpc_async("w1", echo, args=(x,), timeout=30), float(x[0]))
    await resumed.settle(40)
    seen = {
        "warm": warm,
        "during": during.report(),
        "stopped": stopped.report(),
        "timed_out_after_s": timed_out_after,
        "resumed": resumed.report(),
        "debug": asyncrpc.get_debug_info(),
    }
    await asyncrpc.shutdown(timeout=30)
    return seen


# -- c: a worker leaving under load ---------------------------------------------------

LEAVE_AFTER = 75  # echo calls from each caller the leaving worker serves before it leaves
WINDOW = 32  # calls each caller keeps in flight, every other one to the leaving worker


async def leaving_under_load(cfg: Config) -> dict[str, Any]:
    """w0 and w1 call each other and w2 with tensors; w2 leaves (non-graceful shutdown)
    after serving LEAVE_AFTER calls; w0 and w1 go on with each other, then shut down."""
    await cfg.join(rpc_timeout=60)
    if cfg.rank == 2:
        return await _leave_when_told()
    seen = await _load_until_leaver_gone(cfg, "w1" if cfg.rank == 0 else "w0", "w2")
    started = time.monotonic()
    await asyncrpc.shutdown(timeout=30)
    seen["shutdown_s"] = time.monotonic() - started
    return seen


async def _leave_when_told() -> dict[str, Any]:
    stuck = [asyncrpc.rpc_async(w, sleep_for, args=(60,)) for w in ("w0", "w1")]
    async with asyncio.timeout(40):
        await _event("leave").wait()
    await asyncrpc.shutdown(graceful=False)
    ends = await asyncio.gather(*stuck, return_exceptions=True)
    return {"served": dict(_served), "own_calls": [type(e).__name__ for e in ends]}


async def _load_until_leaver_gone(cfg: Config, peer: str, leaver: str) -> dict[str, Any]:
    """A window of 32 tensor calls, to ``peer`` and ``leaver`` in turn while the leaver
    answers, then to ``peer`` only for 300 more calls."""
    with_peer, with_leaver = Tally(peer), Tally(leaver)
    gone: list[float] = []  # when the first call to the leaver failed
    deadline = time.monotonic() + 40

    def note_gone(future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None and not gone:
            gone.append(time.monotonic())

    def issue(i: int) -> asyncio.Future[Any]:
        x = tensor(LARGE if i % 3 == 0 else SMALL, float(cfg.rank * 1_000_000 + i))
        if i % 2 and not gone:
            call = asyncrpc.rpc_async(leaver, echo_counted, args=(x, cfg.name, LEAVE_AFTER))
            with_leaver.track(call, float(x[0])).add_done_callback(note_gone)
            return call
        return with_peer.track(asyncrpc.rpc_async(peer, echo, args=(x,)), float(x[0]))

    after_gone: list[int] = []

    def stop() -> bool:
        if gone and not after_gone:
            after_gone.append(with_peer.issued)
        done = bool(after_gone) and with_peer.issued >= after_gone[0] + 300
        return done or time.monotonic() > deadline

    await pipeline(WINDOW, issue, stop)
    await with_peer.settle(30)
    await with_leaver.settle(30)
    return {
        "leaver_gone": bool(gone),
        "with_peer": with_peer.report(),
        "with_leaver": with_leaver.report(),
        "peer_calls_after_gone": with_peer.issued - after_gone[0] if after_gone else 0,
    }


# -- d: busy workers while a server shuts down ----------------------------------------

BLOCK_S = 5.0  # how long a worker blocks its loop: past the handshake timeout (2 s)


async def busy_workers_during_shutdown(cfg: Config) -> dict[str, Any]:
    """w1 shuts down while w0 (tensor calls in flight to w1, so a link with it) and w2
    (no link with w1: w1 must dial it) have blocked their loops for BLOCK_S seconds.
    w1 must wait for both; every call of w0's, and w2's calls afterwards, succeed."""
    await cfg.join(rpc_timeout=60, handshake_timeout=2.0)
    if cfg.rank == 1:
        async with asyncio.timeout(40):
            await _event("shutdown").wait()
        started = time.monotonic()
        await asyncrpc.shutdown()
        return {"shutdown_s": time.monotonic() - started}
    if cfg.rank == 2:
        return await _call_once_unblocked()
    calls = Tally("w1")
    for i in range(20):  # half answered while w0 is blocked, half after
        x = mixed(i)
        calls.track(asyncrpc.rpc_async("w1", hold, args=(x, 1.0 if i % 2 else 7.0)), float(x[0]))
    await asyncrpc.rpc_async("w1", whoami)  # w1 has every call above
    await asyncrpc.rpc_async("w2", block_loop_soon, args=(BLOCK_S,))  # w2 blocks now
    calls.track(asyncrpc.rpc_async("w1", request_shutdown), "w1")
    await asyncio.sleep(0)  # one loop turn: the request above is written out
    blocked = time.monotonic()
    time.sleep(BLOCK_S)  # blocks this worker's event loop, on purpose
    blocked_s = time.monotonic() - blocked
    await calls.settle(40)
    _calls_after(calls)
    await calls.settle(40)
    seen = {"blocked_s": blocked_s, "calls": calls.report()}
    await asyncrpc.shutdown(timeout=30)
    return seen


async def block_loop_soon(seconds: float) -> str:
    """Answer, then block this worker's event loop for ``seconds`` (the callback runs
    in a later loop turn than this call's reply, which leaves as the call returns)."""
    asyncio.get_running_loop().call_soon(_block, seconds)
    return asyncrpc.get_worker_info().name


def _block(seconds: float) -> None:
    started = time.monotonic()
    time.sleep(seconds)  # blocks this worker's event loop, on purpose
    _blocked.append(time.monotonic() - started)
    _event("unblocked").set()


_blocked: list[float] = []


async def _call_once_unblocked() -> dict[str, Any]:
    """w2: once its loop was blocked (while w1 started to shut down), call w1."""
    async with asyncio.timeout(40):
        await _event("unblocked").wait()
    calls = Tally("w1")
    _calls_after(calls)
    await calls.settle(40)
    seen = {"blocked_s": _blocked[0], "calls": calls.report()}
    await asyncrpc.shutdown(timeout=30)
    return seen


def _calls_after(calls: Tally) -> None:
    """Ten tensor calls to w1, which still serves: it waits for our shutdown."""
    for i in range(10):
        x = mixed(i)
        calls.track(asyncrpc.rpc_async("w1", echo, args=(x,)), float(x[0]))


# -- e: remote code raising KeyboardInterrupt or SystemExit ---------------------------


_RAISERS: dict[str, list[tuple[str, Callable[[str], Any]]]] = {
    "thread": [("rpc", raise_in_thread), ("remote", raise_in_thread)],
    "loop": [
        ("rpc", raise_on_loop),
        ("remote", raise_on_loop),
        ("async_execution", raise_via_async_execution),
    ],
}


async def remote_base_exceptions(cfg: Config) -> dict[str, Any]:
    """w0 has w1 run functions that raise KeyboardInterrupt and SystemExit, in the
    thread pool or on the event loop ($RAISE_WHERE), through ``rpc_async`` and
    ``remote()``, and checks after each that w1 still serves."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        for how, func in _RAISERS[os.environ["RAISE_WHERE"]]:
            for kind in _RAISED:
                call: Awaitable[Any] = (
                    asyncrpc.remote("w1", func, args=(kind,)).to_here()
                    if how == "remote"
                    else asyncrpc.rpc_async("w1", func, args=(kind,))
                )
                seen[f"{how} {kind}"] = await _caught(call)
                alive = asyncrpc.rpc_async("w1", whoami, timeout=10)
                seen[f"alive after {how} {kind}"] = await _caught(alive)
    await asyncrpc.shutdown(timeout=30)
    return seen


async def _caught(call: Awaitable[Any]) -> dict[str, Any]:
    """The call's value, or its error (of any kind: nothing may escape the scenario)."""
    try:
        return {"value": await call}
    except BaseException as exc:  # what reaches the caller is what we observe
        return error_record(exc)
