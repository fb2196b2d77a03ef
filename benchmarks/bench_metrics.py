"""What the always-on call counters cost: asyncrpc with metrics on against off.

``issue 17`` asks that the counters (``asyncrpc.agent.metrics``: per function and
outcome, latency histograms on both sides, bytes per transport) stay on by default,
which holds only if the plain no-op and pipelined rates move by less than 5 %.  This
script measures exactly that, the way ``bench_rpc.py`` measures those rows: a fresh
pair of processes (``w0`` calls, ``server`` serves, loopback, uvloop, ``OMP_NUM_THREADS=1``)
per mode and round, the modes alternating in order from round to round so background
load hits both alike; ``ASYNCRPC_METRICS=0`` is the only difference.

Per pair: the first call (cold: connection and first-run code), then after 1,000
warm-up calls the sequential no-op (median over 10 batches of 1,000 of the mean time per
call, a plain function run in the callee's pool) and the pipelined no-op (20,000 calls,
256 in flight; calls per second).  Each round is printed, then the medians and the
ratio on/off.  Usage: ``python benchmarks/bench_metrics.py [--rounds 5] [--json PATH]``.
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
from pathlib import Path
from typing import Any

import uvloop

import asyncrpc  # (its counters read ASYNCRPC_METRICS when a worker's agent is made)
from asyncrpc.rendezvous import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULT = "BENCH-METRICS "


def noop() -> None:
    """The remote no-op (a plain function: it runs in the callee's thread pool)."""


async def measure(calls: int) -> dict[str, float]:
    started = time.perf_counter()
    await asyncrpc.rpc_async("server", noop)
    first_ms = (time.perf_counter() - started) * 1e3
    for _ in range(1000):
        await asyncrpc.rpc_async("server", noop)
    batches = []
    for _ in range(10):
        started = time.perf_counter()
        for _ in range(calls // 10):
            await asyncrpc.rpc_async("server", noop)
        batches.append((time.perf_counter() - started) / (calls // 10) * 1e6)
    return {
        "first_call_ms": first_ms,
        "noop_us": statistics.median(batches),
        "pipelined_per_s": await pipelined(20_000, 256),
    }


async def pipelined(calls: int, in_flight: int) -> float:
    slots = asyncio.Semaphore(in_flight)
    done = asyncio.Event()
    remaining = calls

    def finished(_: Any) -> None:
        nonlocal remaining
        slots.release()
        remaining -= 1
        if remaining == 0:
            done.set()

    started = time.perf_counter()
    for _ in range(calls):
        await slots.acquire()
        asyncrpc.rpc_async("server", noop).add_done_callback(finished)
    await done.wait()
    return calls / (time.perf_counter() - started)


async def worker(rank: int, port: int, calls: int) -> None:
    name = "w0" if rank == 0 else "server"
    await asyncrpc.init_rpc(
        name, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120
    )
    if rank == 0:
        print(RESULT + json.dumps(await measure(calls)), flush=True)
    await asyncrpc.shutdown()


def run_pair(metrics_on: bool, calls: int) -> dict[str, float]:
    """One fresh pair of processes; the client's figures."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["ASYNCRPC_METRICS"] = "1" if metrics_on else "0"
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), str(port), str(calls)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for line in outputs[1].splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT) :]))
    raise RuntimeError(f"the client reported nothing:\n{outputs[1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10_000, help="sequential calls per pair")
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    parser.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        uvloop.run(worker(*args.worker))
        return 0
    rounds: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for index in range(args.rounds):
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        for mode in order:
            rounds[mode].append(run_pair(mode == "on", args.calls))
        print(f"round {index + 1}: " + "  ".join(_line(m, rounds[m][-1]) for m in ("on", "off")))
    report(rounds)
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=2))
    return 0


def _line(mode: str, figures: dict[str, float]) -> str:
    return (
        f"metrics {mode:>3}: first {figures['first_call_ms']:.2f} ms, "
        f"no-op {figures['noop_us']:.1f} us, pipelined {figures['pipelined_per_s']:,.0f}/s"
    )


def report(rounds: dict[str, list[dict[str, float]]]) -> None:
    print(f"\nmedian of {len(rounds['on'])} rounds      metrics on   metrics off   on/off")
    for key, unit in (("first_call_ms", "ms"), ("noop_us", "us"), ("pipelined_per_s", "/s")):
        on = statistics.median(r[key] for r in rounds["on"])
        off = statistics.median(r[key] for r in rounds["off"])
        print(f"{key:<24} {on:>10.2f}{unit:<3} {off:>10.2f}{unit:<3} {on / off:>7.3f}")


if __name__ == "__main__":
    sys.exit(main())
