"""One worker of the soak (started by soak.py): mixed traffic to the others, accounted.

For ``--duration`` seconds it runs, at once: no-op calls (plain and ``async def``),
tensor echoes of varied sizes (inline and through shared memory), RRef work
(``remote()``, ``to_here``, method calls, forks to a third worker, local RRefs
fetched back), distributed autograd steps on a model split with the next worker,
and calls that fail on purpose (a remote ValueError, a short timeout).  Every call
goes through a :class:`Ledger`, which counts it issued, then completed or failed
(by exception type), and flags what was not expected.  Every ``--sample-every``
seconds it samples RSS (``/proc/self/statm``), the loop lag and the counts.  Then it
stops issuing, waits for what is in flight (a call still open after that is lost),
shuts down gracefully and writes its report as JSON.  SIGUSR1 ends the traffic early
(soak.py sends it to the others when a worker crashes, so that they still report).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import _soak_fns as fns
import torch
import uvloop
from torch.nn.functional import cross_entropy

import asyncrpc
from asyncrpc.agent import current_agent

KIB, MIB = 1 << 10, 1 << 20
TENSOR_BYTES = (256, 4 * KIB, 64 * KIB, 512 * KIB, 1 * MIB, 3 * MIB, 8 * MIB)
SHM_FROM = 1 * MIB  # asyncrpc.transport.SHM_THRESHOLD: from this size, shared memory
RPC_TIMEOUT = 30.0
DRAIN_LIMIT_S = RPC_TIMEOUT + 15.0  # every call ends by its timeout; later than this: lost
SHUTDOWN_LIMIT_S = 90.0
LAG_TICK_S = 0.02
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- accounting -----------------------------------------------------------------------


@dataclass
class KindStats:
    issued: int = 0
    completed: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    unexpected: int = 0
    samples: list[str] = field(default_factory=list)  # the first few unexpected outcomes

    def flag(self, what: str) -> None:
        self.unexpected += 1
        if len(self.samples) < 5:
            self.samples.append(what)

    def report(self) -> dict[str, Any]:
        return {
            "issued": self.issued,
            "completed": self.completed,
            "failed": dict(self.failed),
            "unexpected": self.unexpected,
            "unexpected_samples": self.samples,
        }


class Ledger:
    """Every call of the soak: issued, then exactly one of completed or failed."""

    def __init__(self) -> None:
        self.kinds: defaultdict[str, KindStats] = defaultdict(KindStats)
        self.open: dict[int, tuple[str, float]] = {}  # calls in flight: kind, start time
        self._ids = itertools.count()

    async def call(
        self,
        kind: str,
        start: Callable[[], Awaitable[Any]],
        expect_error: type[BaseException] | None = None,
        check: Callable[[Any], bool] | None = None,
    ) -> Any:
        """Start a call with ``start()`` and await it (an error raised by ``start``
        itself counts as its failure).  ``expect_error``: it must raise that;
        ``check``: its value must pass.  Returns the value (None if it raised)."""
        stats = self.kinds[kind]
        stats.issued += 1
        token = next(self._ids)
        self.open[token] = (kind, time.monotonic())
        try:
            value = await start()
        except Exception as exc:
            del self.open[token]
            stats.failed[type(exc).__name__] += 1
            if expect_error is None or not isinstance(exc, expect_error):
                stats.flag(f"{type(exc).__name__}: {str(exc)[:300]}")
            return None
        del self.open[token]  # (a CancelledError leaves it open: counted as lost)
        stats.completed += 1
        if expect_error is not None:
            stats.flag(f"returned {value!r} instead of raising {expect_error.__name__}")
        elif check is not None and not check(value):
            stats.flag(f"wrong value: {str(value)[:200]}")
        return value

    def totals(self) -> dict[str, int]:
        kinds = self.kinds.values()
        return {
            "issued": sum(k.issued for k in kinds),
            "completed": sum(k.completed for k in kinds),
            "failed": sum(sum(k.failed.values()) for k in kinds),
            "unexpected": sum(k.unexpected for k in kinds),
            "open": len(self.open),
        }


# -- traffic --------------------------------------------------------------------------


@dataclass
class Traffic:
    me: str
    peers: list[str]
    ledger: Ledger
    rng: random.Random
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    losses: list[float] = field(default_factory=list)

    def peer(self) -> str:
        return self.rng.choice(self.peers)

    @property
    def running(self) -> bool:
        return not self.stop.is_set()


async def noops(t: Traffic) -> None:
    while t.running:
        await t.ledger.call("noop", lambda: asyncrpc.rpc_async(t.peer(), fns.noop))
        await t.ledger.call("coro_noop", lambda: asyncrpc.rpc_async(t.peer(), fns.coro_noop))


async def tensors(t: Traffic) -> None:
    while t.running:
        nbytes = t.rng.choice(TENSOR_BYTES)
        x = torch.rand(nbytes // 4)
        kind = "tensor_shm" if nbytes >= SHM_FROM else "tensor_inline"
        await t.ledger.call(
            kind,
            partial(asyncrpc.rpc_async, t.peer(), fns.echo, args=(x,)),
            check=partial(torch.equal, x),
        )


async def rrefs(t: Traffic) -> None:
    """remote() on one peer, used from here and from the third worker, then dropped;
    and an RRef of ours that a peer fetches back."""
    while t.running:
        owner = t.peer()
        third = next(p for p in t.peers if p != owner)
        rref = asyncrpc.remote(owner, fns.Accumulator, args=(torch.ones(16),))
        await rref_round(t.ledger, rref, owner, third)
        del rref


async def rref_round(
    ledger: Ledger, rref: asyncrpc.RRef[fns.Accumulator], owner: str, third: str
) -> None:
    await ledger.call("rref_method", lambda: rref.rpc_async().add(torch.ones(16)), check=_eq(16))
    await ledger.call("rref_to_here", rref.to_here, check=lambda a: float(a.value.sum()) == 32.0)
    await ledger.call(
        "rref_fork", lambda: asyncrpc.rpc_async(third, fns.total_of, args=(rref,)), check=_eq(32.0)
    )
    mine = asyncrpc.RRef(torch.arange(8.0))
    await ledger.call(
        "rref_local", lambda: asyncrpc.rpc_async(owner, fns.sum_of, args=(mine,)), check=_eq(28.0)
    )


async def autograd_steps(t: Traffic) -> None:
    """Training steps of a model split in two: the first stage here, the second on the
    next worker, with distributed autograd and a DistributedOptimizer."""
    ledger = t.ledger
    torch.manual_seed(0)
    stage1 = torch.nn.Sequential(torch.nn.Linear(fns.FEATURES, fns.FEATURES), torch.nn.ReLU())
    stage2 = asyncrpc.remote(t.peers[0], fns.Stage)
    remote_params = await ledger.call(
        "autograd_setup", lambda: stage2.rpc_async().parameter_rrefs()
    )
    if remote_params is None:
        return
    params = [asyncrpc.RRef(p) for p in stage1.parameters()] + remote_params
    opt = asyncrpc.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    x = torch.randn(fns.BATCH, fns.FEATURES)
    y = torch.randint(0, fns.CLASSES, (fns.BATCH,))
    while t.running:
        loss = await autograd_step(ledger, stage1, stage2, opt, x, y)
        if loss is None:
            await _pause(t, 0.1)  # a failed step was flagged; do not spin on it
        else:
            t.losses.append(loss)


async def autograd_step(
    ledger: Ledger,
    stage1: torch.nn.Module,
    stage2: asyncrpc.RRef[fns.Stage],
    opt: asyncrpc.optim.DistributedOptimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float | None:
    """One step: forward through both stages, backward, this worker's gradients
    (stage 1's weight and bias), an optimizer step.  Returns the loss (None on failure)."""
    async with asyncrpc.autograd.context() as ctx:
        out = await ledger.call("autograd_forward", lambda: stage2.rpc_async().forward(stage1(x)))
        if out is None:
            return None
        loss = cross_entropy(out, y)
        await ledger.call("autograd_backward", lambda: asyncrpc.autograd.backward(ctx, [loss]))
        grads = asyncrpc.autograd.get_gradients(ctx)
        if len(grads) != 2:
            ledger.kinds["autograd_backward"].flag(f"{len(grads)} local gradients, not 2")
        await ledger.call("optimizer_step", lambda: opt.step(ctx))
    return float(loss)


async def deliberate_failures(t: Traffic) -> None:
    """A remote ValueError every 0.25 s and a call that times out every second."""
    for i in itertools.count():
        if not t.running:
            return
        await t.ledger.call(
            "remote_error",
            partial(asyncrpc.rpc_async, t.peer(), fns.fail, args=(f"on purpose {i}",)),
            expect_error=ValueError,
        )
        if i % 4 == 0:
            await t.ledger.call(
                "timeout",
                lambda: asyncrpc.rpc_async(t.peer(), fns.sleep_for, args=(3.0,), timeout=0.2),
                expect_error=asyncrpc.RPCTimeoutError,
            )
        await _pause(t, 0.25)  # pacing this stream, not synchronising anything


def _eq(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


async def _pause(t: Traffic, seconds: float) -> None:
    """Wait ``seconds``, or less if the traffic stops meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(t.stop.wait(), seconds)


TRAFFIC: list[tuple[Callable[[Traffic], Coroutine[Any, Any, None]], int]] = [
    (noops, 6),
    (tensors, 3),
    (rrefs, 2),
    (autograd_steps, 1),
    (deliberate_failures, 1),
]
"""Each stream and how many copies of it run at once (calls in flight per stream)."""


# -- monitoring -----------------------------------------------------------------------


def rss_mb() -> tuple[float, float]:
    """Resident memory and the part of it that is shared (the shared-memory segments
    this worker and its peers map count there), in MiB, from ``/proc/self/statm``."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return int(fields[1]) * PAGE / MIB, int(fields[2]) * PAGE / MIB


@dataclass
class Monitor:
    started: float = field(default_factory=time.monotonic)
    lag_max_s: float = 0.0
    window_lag_s: float = 0.0
    lags: list[float] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)

    async def measure_lag(self, stop: asyncio.Event) -> None:
        """How late the loop wakes a task that asked to sleep LAG_TICK_S."""
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            lag = time.perf_counter() - before - LAG_TICK_S
            self.window_lag_s = max(self.window_lag_s, lag)
            self.lag_max_s = max(self.lag_max_s, lag)
            self.lags.append(lag)

    def lag_percentiles_ms(self) -> dict[str, float]:
        ordered = sorted(self.lags) or [0.0]
        at = {"p50": 0.5, "p99": 0.99, "p999": 0.999}
        return {
            name: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)
            for name, q in at.items()
        }

    async def sample_every(self, seconds: float, t: Traffic) -> None:
        self.sample(t)
        while t.running:
            await _pause(t, seconds)
            self.sample(t)

    def sample(self, t: Traffic) -> None:
        info = asyncrpc.get_debug_info()
        rss, shared = rss_mb()
        sample = {
            "t": round(time.monotonic() - self.started, 2),
            "rss_mb": round(rss, 1),
            "rss_shared_mb": round(shared, 1),
            "loop_lag_max_ms": round(self.window_lag_s * 1e3, 2),
            **t.ledger.totals(),
            "owner_rrefs": info.get("owner_rrefs"),
            "user_rrefs": info.get("user_rrefs"),
            "autograd_contexts": info.get("autograd_contexts"),
            "shm_segments": _segments(info),
        }
        self.window_lag_s = 0.0
        self.samples.append(sample)
        print(f"[{t.me}] {json.dumps(sample)}", flush=True)


def _segments(info: dict[str, Any]) -> int | None:
    shm = info.get("shared_memory")
    return None if shm is None else shm["segments_in_use"] + shm["segments_idle"]


# -- the worker -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Args:
    rank: int
    world: int
    port: int
    out: Path
    duration: float
    sample_every: float
    seed: int


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description="one soak worker (started by soak.py)")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("out", type=Path, help="where this worker writes its report (JSON)")
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    return Args(ns.rank, ns.world, ns.port, ns.out, ns.duration, ns.sample_every, ns.seed)


async def run_traffic(t: Traffic, monitor: Monitor, args: Args) -> dict[str, Any]:
    """Run every stream for ``args.duration`` seconds, then let the calls in flight end."""
    streams = [asyncio.create_task(s(t)) for s, copies in TRAFFIC for _ in range(copies)]
    lag = asyncio.create_task(monitor.measure_lag(t.stop))
    sampler = asyncio.create_task(monitor.sample_every(args.sample_every, t))
    await _pause(t, args.duration)
    t.stop.set()
    stopped = time.monotonic()
    _, stuck = await asyncio.wait(streams, timeout=DRAIN_LIMIT_S)
    lost = [{"kind": kind, "age_s": round(stopped - at, 1)} for kind, at in t.ledger.open.values()]
    for task in [*stuck, lag, sampler]:
        task.cancel()
    crashed = [repr(task.exception()) for task in streams if task.done() and task.exception()]
    return {"drain_s": round(time.monotonic() - stopped, 2), "lost": lost, "crashed": crashed}


async def main(args: Args) -> None:
    name = f"w{args.rank}"
    await asyncrpc.init_rpc(
        name,
        rank=args.rank,
        world_size=args.world,
        init_method=f"tcp://127.0.0.1:{args.port}",
        rpc_timeout=RPC_TIMEOUT,
    )
    peers = [f"w{(args.rank + i) % args.world}" for i in range(1, args.world)]
    t = Traffic(name, peers, Ledger(), random.Random(args.seed * 1000 + args.rank))
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, t.stop.set)  # stop early
    monitor = Monitor()
    ended = await run_traffic(t, monitor, args)
    monitor.sample(t)
    started = time.monotonic()
    agent = current_agent()
    await asyncrpc.shutdown(timeout=SHUTDOWN_LIMIT_S)
    left = agent.closing_debug_info if agent is not None else {}
    report = {
        "worker": name,
        **ended,
        "shutdown_s": round(time.monotonic() - started, 2),
        "totals": t.ledger.totals(),
        "kinds": {kind: s.report() for kind, s in sorted(t.ledger.kinds.items())},
        "samples": monitor.samples,
        "loop_lag_max_ms": round(monitor.lag_max_s * 1e3, 2),
        "loop_lag_ms": monitor.lag_percentiles_ms(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "losses": t.losses[:1] + t.losses[-1:],
        "steps": len(t.losses),
        "left_at_close": {
            key: left.get(key)
            for key in ("pending_outgoing_calls", "owner_rrefs", "user_rrefs", "autograd_contexts")
        },
    }
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    worker_args = parse_args()
    torch.set_num_threads(1)
    uvloop.run(main(worker_args))
    sys.exit(0)
