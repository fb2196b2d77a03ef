"""Same-host shared memory: tensor echo times, and what a burst of large calls costs.

Two fresh asyncrpc processes on this host (``w0`` drives, ``w1`` serves), on uvloop,
talking over a unix socket and shared-memory segments:

1. echo: ``echo(x)`` returns its float32 argument of 4 and 64 MB (``--big``: also
   400 MB; MB = 2**20 bytes); the median round trip after a checked warm-up.
2. burst: ``--calls`` concurrent calls of ``consume(x)`` (a plain function that reads
   two elements), each carrying the same ``--size`` MB tensor.  Reported: how long
   issuing them took (the caller's loop is blocked meanwhile), how late the caller's
   loop woke at worst while they ran (a 10 ms timer, sampled throughout), the wall
   time until all were answered, the most shared memory the caller held (lent plus
   idle, sampled; and the pool's own peak), and how many buffers went through the
   socket because the budget was full.
3. after: ``IDLE_GRACE`` plus half a second later, the caller's idle segments and
   the bytes of the caller's segments that the callee keeps mapped.

Usage: ``python benchmarks/bench_shm.py [--big] [--calls N] [--size MB]
[--budget MB]``; it prints one JSON line.  Small VMs are noisy: compare runs made
back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import uvloop

import asyncrpc
from asyncrpc.rendezvous import free_port
from asyncrpc.transport import shm

MB = 1 << 20
IDLE_GRACE = getattr(shm, "IDLE_GRACE", 1.0)  # runs on trees from before the budget too
CALLEE = "w1"


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def consume(x: torch.Tensor) -> float:
    return float(x[0]) + float(x[-1])


def shared_memory() -> dict[str, Any]:
    """This worker's ``get_debug_info()["shared_memory"]`` (also called remotely)."""
    return dict(asyncrpc.get_debug_info()["shared_memory"] or {})


def held_bytes() -> int:
    info = shared_memory()
    return int(info.get("bytes_in_use", 0)) + int(info.get("bytes_idle", 0))


def make_tensor(size_mb: int) -> torch.Tensor:
    x = torch.ones(size_mb * MB // 4)
    x[0], x[-1] = 3.0, 7.0
    return x


async def echo_ms(size_mb: int, repeats: int) -> float:
    x = make_tensor(size_mb)
    if not torch.equal(await asyncrpc.rpc_async(CALLEE, echo, args=(x,)), x):
        raise AssertionError("echo returned other bytes")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await asyncrpc.rpc_async(CALLEE, echo, args=(x,))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Watch:
    """Every 10 ms: how late the loop woke, and the shared memory this worker holds."""

    def __init__(self) -> None:
        self.lag = 0.0
        self.held = held_bytes()
        self.running = True
        self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        while self.running:
            start = time.perf_counter()
            await asyncio.sleep(0.01)  # the probe itself: how late does it wake?
            self.lag = max(self.lag, time.perf_counter() - start - 0.01)
            self.held = max(self.held, held_bytes())

    async def stop(self) -> None:
        self.running = False
        await self.task


async def burst(calls: int, size_mb: int) -> dict[str, Any]:
    x = make_tensor(size_mb)
    await asyncrpc.rpc_async(CALLEE, consume, args=(torch.ones(4),))
    watch = Watch()
    await asyncio.sleep(0)  # the watch is waiting: a blocked loop wakes it late
    start = time.perf_counter()
    futures = [asyncrpc.rpc_async(CALLEE, consume, args=(x,)) for _ in range(calls)]
    issued = time.perf_counter() - start
    watch.held = max(watch.held, held_bytes())
    results = await asyncio.gather(*futures)
    total = time.perf_counter() - start
    await watch.stop()
    if results != [10.0] * calls:
        raise AssertionError("a call saw other bytes")
    info = shared_memory()
    return {
        "issue_s": issued,
        "max_loop_lag_s": watch.lag,
        "total_s": total,
        "max_held_mb": watch.held / MB,
        "peak_mb": info["peak_bytes"] / MB if "peak_bytes" in info else None,
        "fallbacks": info.get("fallbacks"),
    }


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [(4, 20), (64, 10), *([(400, 5)] if args.big else [])]
    results: dict[str, Any] = {"echo_ms": {}}
    for size_mb, repeats in sizes:
        results["echo_ms"][size_mb] = round(await echo_ms(size_mb, repeats), 2)
    results["burst"] = await burst(args.calls, args.size)
    await asyncio.sleep(IDLE_GRACE + 0.5)  # idle segments past their grace are closed
    await asyncrpc.rpc_async(CALLEE, consume, args=(torch.ones(4),))  # UNMAPs have landed
    mine = shared_memory()
    results["after"] = {
        "caller_idle_mb": mine.get("bytes_idle", mine.get("idle_bytes", 0)) / MB,
        "caller_segments_idle": mine.get("segments_idle"),
        "callee_maps_mb": (await asyncrpc.rpc_async(CALLEE, shared_memory)).get("mapped_bytes", 0)
        / MB,
    }
    results["caller_shared_memory"] = mine
    return results


async def main(rank: int, port: int, args: argparse.Namespace) -> None:
    options: dict[str, Any] = {}
    if args.budget is not None:
        options["shared_memory_budget"] = args.budget * MB
    await asyncrpc.init_rpc(
        f"w{rank}",
        rank=rank,
        world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=300,
        **options,
    )
    try:
        if rank == 0:
            print(json.dumps(await drive(args)), flush=True)
    finally:
        await asyncrpc.shutdown()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--big", action="store_true", help="also echo 400 MB")
    parser.add_argument("--calls", type=int, default=20, help="calls in the burst (20)")
    parser.add_argument("--size", type=int, default=64, help="MB per burst call (64)")
    parser.add_argument("--budget", type=int, help="shared_memory_budget in MB")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    if arguments.rank is not None:
        uvloop.run(main(arguments.rank, arguments.port, arguments))
        sys.exit(0)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, *sys.argv[1:], "--port", str(port)]
    workers = [subprocess.Popen([*command, "--rank", str(rank)], env=env) for rank in (0, 1)]
    sys.exit(max(worker.wait(timeout=600) for worker in workers))
