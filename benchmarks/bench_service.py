"""Load test of examples/inference_service.py: batched (``@batch``) against unbatched.

What it does
------------
Starts the service twice on loopback (``--serve``: an aiohttp front end plus
``--models`` model worker processes), once batched -- each row is a call to the
``@batch`` function ``predict_rows``, so rows that reach a worker together run as
one forward pass -- and once with ``--no-batch`` -- the same MLP, one forward pass
per call (``predict_one``).  Against each, an aiohttp client posts single-row JSON
requests (``{"input": [...]}``) from 1, 16, 64 and 256 concurrent clients, at most
``--requests`` requests and ``--duration`` seconds per point, after a warm-up.

The model is chosen so that a forward pass costs mostly fixed overhead, as a
small model on an accelerator does: the service's narrow, deep MLP (``--depth``,
by default 256 blocks of width 64) spends its time dispatching ops, not
multiplying rows, so 64 rows cost about 1.5 times what 1 row does (the bench
measures and prints both).  That is where batching pays; for a model whose cost
grows with its rows it pays much less.

What it reports
---------------
Per mode and concurrency: requests per second, p50 and p99 latency, and failures
(any answer but 200, or no answer: counted by status or exception, never dropped),
as a table, with the batched/unbatched throughput ratio per concurrency.  The
service's batch queue (``--max-queue``, 1024 rows per worker) is above the highest
concurrency, so every failure here is a bug.  ``--json PATH`` writes every
figure, ``--plot PATH`` draws throughput and latency against concurrency
(matplotlib; skipped with a note when it is missing).  Exit status 1 if any
request failed.

Usage: ``python benchmarks/bench_service.py [--json PATH] [--plot PATH]`` (about
a minute and a half); ``--quick`` is a tiny run for the test suite.  Every process
shares the machine's cores (client, front end and model workers): on a 2-core VM
the client's and the front end's HTTP handling, not the model, bound the batched
throughput, and other jobs on the machine move the figures a lot (the 1-minute
load average is printed and kept in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "examples" / "inference_service.py"
sys.path.insert(0, str(SERVICE.parent))
import inference_service as service  # noqa: E402  (its model, to time it here)
from _common import pyplot  # noqa: E402

MODES = ("batched", "unbatched")
STARTUP_S = 90.0  # imports and rendezvous of 3 processes on a busy 2-core machine
STOP_S = 30.0
REQUEST_TIMEOUT_S = 60.0


@dataclass
class Point:
    """One mode at one concurrency."""

    mode: str
    concurrency: int
    requests: int = 0
    ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    requests_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0


def forward_cost(depth: int) -> dict[str, float]:
    """Milliseconds of one forward pass of the service's MLP over 1 and over 64 rows."""
    import torch

    torch.set_num_threads(1)
    model = service.build_model(depth)
    costs = {}
    with torch.no_grad():
        for rows in (1, 64):
            x = torch.randn(rows, service.FEATURES)
            for _ in range(20):
                model(x)
            started = time.perf_counter()
            for _ in range(200):
                model(x)
            costs[f"rows_{rows}_ms"] = (time.perf_counter() - started) / 200 * 1e3
    return costs


class RunningService:
    """The service as a subprocess (``--serve``), on a port it binds itself.

    It binds any free port (``--port 0``) and says which on its first stdout line
    (``SERVING <url>``): a port chosen here and handed over would be free only
    until the service's own processes opened connections, any of which may take it.
    """

    def __init__(self, args: argparse.Namespace, batched: bool) -> None:
        command = [
            *(sys.executable, str(SERVICE), "--serve", "--port", "0"),
            *("--models", str(args.models), "--depth", str(args.depth)),
            *(() if batched else ("--no-batch",)),
            *(() if args.max_wait is None else ("--max-wait", str(args.max_wait))),
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        self.url = ""
        self.models = args.models

    async def ready(self, session: aiohttp.ClientSession) -> None:
        """Wait (at most STARTUP_S) until /health says every model worker is live."""
        deadline = time.monotonic() + STARTUP_S
        self.url = await asyncio.wait_for(self._served_url(), STARTUP_S)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited {self.proc.returncode} at startup")
            try:
                async with session.get(f"{self.url}/health") as answer:
                    if answer.status == 200 and (await answer.json())["live"] == self.models:
                        return
            except aiohttp.ClientError:
                pass  # not listening yet
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the service was not ready within {STARTUP_S:.0f} s")

    async def _served_url(self) -> str:
        """The URL of the service's ``SERVING`` line; the rest of its stdout is discarded."""
        stdout = self.proc.stdout
        assert stdout is not None
        while line := await asyncio.to_thread(stdout.readline):  # off the loop
            if line.startswith("SERVING "):
                threading.Thread(target=deque, args=(stdout, 0), daemon=True).start()
                return line.split()[1]
        returncode = await asyncio.to_thread(self.proc.wait, STOP_S)
        raise RuntimeError(f"the service exited {returncode} at startup")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within STOP_S."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            print("warning: the service did not stop in time; killed", file=sys.stderr)
            self.proc.kill()
            self.proc.wait()


async def measure(
    session: aiohttp.ClientSession, url: str, point: Point, requests: int, duration: float
) -> Point:
    """``point.concurrency`` clients post until ``requests`` were sent or ``duration`` ran out."""
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    body = json.dumps({"input": [0.1 * i for i in range(16)]}).encode()
    headers = {"Content-Type": "application/json"}
    sent = 0
    started = time.perf_counter()
    deadline = started + duration

    async def client() -> None:
        nonlocal sent
        while sent < requests and time.perf_counter() < deadline:
            sent += 1
            began = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as answer:
                    await answer.read()
                    status = answer.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                failures[type(exc).__name__] += 1
                continue
            if status == 200:
                latencies.append(time.perf_counter() - began)
            else:
                failures[f"HTTP {status}"] += 1

    await asyncio.gather(*(client() for _ in range(point.concurrency)))
    point.seconds = time.perf_counter() - started
    point.requests, point.ok, point.failures = sent, len(latencies), dict(failures)
    point.requests_per_s = len(latencies) / point.seconds
    if len(latencies) >= 2:
        cuts = statistics.quantiles(latencies, n=100, method="inclusive")
        point.p50_ms, point.p99_ms = statistics.median(latencies) * 1e3, cuts[98] * 1e3
    return point


async def bench_mode(args: argparse.Namespace, mode: str) -> list[Point]:
    """Start the service in ``mode``, warm it up, measure every concurrency, stop it."""
    running = RunningService(args, batched=mode == "batched")
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=max(args.concurrency))
    points = []
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await running.ready(session)
            url = f"{running.url}/predict"
            await measure(session, url, Point(mode, 16), args.warmup, args.duration)
            for concurrency in args.concurrency:
                point = await measure(
                    session, url, Point(mode, concurrency), args.requests, args.duration
                )
                print(row(point), flush=True)
                points.append(point)
    finally:
        running.stop()
    return points


def row(point: Point) -> str:
    failed = sum(point.failures.values())
    return (
        f"{point.mode:>9} | {point.concurrency:>11} | {point.requests:>8} | "
        f"{point.requests_per_s:>8.0f} | {point.p50_ms:>7.1f} | {point.p99_ms:>7.1f} | "
        f"{failed:>6}"
    )


def speedups(results: dict[str, list[Point]]) -> dict[int, float]:
    """Batched over unbatched throughput, per concurrency."""
    unbatched = {p.concurrency: p.requests_per_s for p in results.get("unbatched", [])}
    return {
        p.concurrency: p.requests_per_s / unbatched[p.concurrency]
        for p in results.get("batched", [])
        if unbatched.get(p.concurrency)
    }


def plot(path: Path, results: dict[str, list[Point]], title: str) -> None:
    """Throughput and latency (p50 solid, p99 dashed) against concurrency."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for mode, points in results.items():
        counts = [p.concurrency for p in points]
        left.plot(counts, [p.requests_per_s for p in points], marker="o", label=mode)
        (line,) = right.plot(counts, [p.p50_ms for p in points], marker="o", label=f"{mode} p50")
        right.plot(counts, [p.p99_ms for p in points], "--", color=line.get_color(), label="p99")
    left.set(xlabel="concurrent clients", ylabel="requests/s", title="throughput")
    right.set(xlabel="concurrent clients", ylabel="ms", title="latency")
    right.set_yscale("log")
    counts = [p.concurrency for points in results.values() for p in points]
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted(set(counts)), [str(c) for c in sorted(set(counts))])
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    left.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated")
    parser.add_argument("--requests", type=int, default=3000, help="at most, per point")
    parser.add_argument("--duration", type=float, default=10.0, help="s at most, per point")
    parser.add_argument("--warmup", type=int, default=300, help="requests before measuring")
    parser.add_argument("--models", type=int, default=2, help="model worker processes")
    parser.add_argument("--depth", type=int, default=service.DEPTH, help="hidden blocks of the MLP")
    parser.add_argument("--max-wait", type=float, help="the service's batching window (s)")
    parser.add_argument("--modes", default=",".join(MODES), help="batched,unbatched or one")
    parser.add_argument("--quick", action="store_true", help="a tiny run (for tests)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plot", type=Path, help="draw the curves here (PNG)")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.modes = [m for m in MODES if m in args.modes.split(",")]
    if args.quick:
        args.requests, args.duration, args.warmup = 40, 5.0, 10
    return args


async def main() -> int:
    args = parse_args()
    cost = forward_cost(args.depth)
    fixed = (
        f"model: MLP 16 -> 64 -> {args.depth} x (LayerNorm, ReLU, Linear 64) -> 4\n"
        f"a forward pass costs {cost['rows_1_ms']:.2f} ms over 1 row, "
        f"{cost['rows_64_ms']:.2f} ms over 64 (mostly fixed per-call overhead)"
    )
    print(fixed)
    load_before = os.getloadavg()[0]
    print(f"{'mode':>9} | concurrency | requests |    req/s | p50 ms  | p99 ms  | failed")
    results = {mode: await bench_mode(args, mode) for mode in args.modes}
    ratio = speedups(results)
    for concurrency, speedup in ratio.items():
        print(f"batched / unbatched throughput at concurrency {concurrency}: {speedup:.1f}x")
    failed = sum(sum(p.failures.values()) for points in results.values() for p in points)
    load = (load_before, os.getloadavg()[0])
    print(f"failed requests: {failed}")
    for point in (p for points in results.values() for p in points if p.failures):
        print(f"  {point.mode} at concurrency {point.concurrency}: {point.failures}")
    print(f"1-minute load average: {load[0]:.1f} before, {load[1]:.1f} after")
    if args.json:
        payload = {
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "forward_ms": cost,
            "results": {mode: [asdict(p) for p in points] for mode, points in results.items()},
            "speedup": ratio,
            "failed": failed,
            "load_average": load,
            "cpus": os.cpu_count(),
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    if args.plot:
        plot(args.plot, results, fixed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
