"""Speed benchmark: asyncrpc against torch.distributed.rpc (TensorPipe) on one host.

What it measures
----------------
Each framework runs as two fresh worker processes talking over loopback: ``w0``
calls, ``w1`` serves.  Only one pair runs at a time, so the frameworks never
compete for cores; a full run alternates torch and asyncrpc for five rounds
(``--rounds``) so that background load hits both alike.  On a shared VM a whole
round can land in a slow spell (round medians of one workload have differed by
2x within a run), hence five.  Each workload warms up first; a row reports the
median over rounds of each round's median.  Every worker
runs with ``OMP_NUM_THREADS=1``, as torchrun sets for multi-process jobs.

1. no-op round trip: ``noop()`` (a plain function, run in the callee's thread
   pool) called sequentially; per round, the median over batches of the mean
   time per call.
2. coroutine no-op round trip: asyncrpc calls ``async def coro_noop()``, which
   runs on the callee's event loop.  torch cannot run coroutines, so its number
   is the faster of its plain no-op and an ``@rpc.functions.async_execution``
   function returning an already-completed Future (the row says which).
3. remote + to_here round trip: ``rref = remote(w1, add, args=(1, 2))`` then
   ``await rref.to_here()`` (torch: ``rpc.remote`` then the blocking
   ``to_here()``), sequentially, timed like row 1.  The RRef is dropped after
   each iteration, so its cost includes both frameworks' delete message to the
   owner (sent in the background, but it shares the link and the callee).
4. RRef proxy method call round trip: one ``rref = remote(w1, Box)`` made up
   front, then ``await rref.rpc_async().get()`` (torch:
   ``rref.rpc_async().get().wait()``), a plain method returning a small int,
   sequentially, timed like row 1.
5. model-parallel step: one SGD training step (lr 0.01) of an MLP split over
   the pair, on a fixed 32 x 256 float32 batch with fixed labels.  Stage 1
   (Linear(256, 256) + ReLU) is a local module on ``w0``; stage 2 (Linear(256,
   256) + ReLU + Linear(256, 10)) is a ``Stage2`` made once on ``w1`` with
   ``remote()``.  Each step opens a distributed autograd context, runs stage 1,
   then ``await stage2.rpc_async().forward(h)`` (torch: ``rpc_sync()``), takes
   the cross-entropy loss, runs the distributed backward, and steps a
   ``DistributedOptimizer`` over both stages' parameter RRefs (asyncrpc's, or
   ``torch.distributed.optim``'s), then leaves the context.  Sequential steps,
   timed like row 1 (smaller counts); the loss must fall over the run.
6. pipelined no-op: ``noop()`` with 256 calls in flight at all times; calls per
   second over 20,000 calls.
7. tensor echo: ``echo(x)`` returns its float32 argument of 4, 64 and 400 MB
   (MB = 2**20 bytes); round-trip time after a warm-up whose result is checked.
8. memory: growth of the callee's peak RSS (``ru_maxrss``) while it receives
   the largest tensor, before any other large transfer in that process pair
   (the worst round counts).  The target is about the tensor's own size: at
   most 1.1 times it, judged from 64 MB up.

How to read it
--------------
``ratio`` is how many times better asyncrpc does: torch time / asyncrpc time
for latencies, asyncrpc rate / torch rate for throughput; ``target`` is the
ratio asyncrpc must reach and ``met`` says whether it did.  For the memory row
the ratio is asyncrpc's growth divided by the tensor size.  Notes under the
table name torch's coroutine stand-in, the callee's growth over a whole echo,
and calls, shared-memory segments or RRefs asyncrpc still held at the end.
Small machines are noisy (the load average is printed): compare runs on the
same machine, and look at the per-sample numbers that ``--json`` writes.  On small
VMs, waking a process on another vCPU can cost more than the RPC itself, and
where the OS places the two workers varies from run to run; ``--pin same`` or
``--pin split`` fixes the placement (one shared CPU, or one CPU each).

Usage: ``python benchmarks/bench_rpc.py [--quick] [--only torch|asyncrpc]
[--rounds N] [--pin same|split] [--json PATH]``.  ``--quick`` (one round, small
counts, tensors up to 4 MB, well under a minute) is the smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # also importable as ``python -m benchmarks.bench_rpc``
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import Config, Results, config, median  # noqa: E402

SIDES = ("torch", "asyncrpc")
WORKERS = {"torch": HERE / "_torch_worker.py", "asyncrpc": HERE / "_asyncrpc_worker.py"}
SIDE_LIMIT_S = {"quick": 90.0, "full": 300.0}
MEMORY_TARGET = 1.1
TIMES = "\N{MULTIPLICATION SIGN}"
MEMORY_JUDGED_FROM_MB = 64  # below this, allocator and page noise swamp the tensor itself
LOG_TAIL_LINES = 20


Pinning = tuple[int | None, int | None]
"""The CPU each rank is bound to (None: wherever the OS schedules it)."""


class BenchError(RuntimeError):
    """A worker failed or overran its time limit."""


# -- running one side -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# One intra-op thread per worker process, for both frameworks: what torchrun sets for
# multi-process jobs (OMP_NUM_THREADS=1), and two processes share this host's cores.
WORKER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def spawn_worker(
    side: str, rank: int, port: int, *, out: Path, quick: bool, cpu: int | None, log: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(WORKERS[side]), str(rank), str(port), str(out)]
    if quick:
        command.append("--quick")
    if cpu is not None:
        command.append(f"--cpu={cpu}")
    with log.open("wb") as sink:
        return subprocess.Popen(
            command,
            env=WORKER_ENV,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def log_tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill whichever of our workers still run, and reap them (bounded)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"warning: worker pid {proc.pid} did not exit after SIGKILL", file=sys.stderr)


def wait_all(procs: list[subprocess.Popen[bytes]], logs: list[Path], limit_s: float) -> None:
    """Wait until every worker exits 0; raise at the first failure or at the deadline."""
    deadline = time.monotonic() + limit_s
    while any(p.poll() is None for p in procs):
        for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
            if proc.returncode not in (None, 0):
                raise BenchError(
                    f"worker rank {rank} exited with {proc.returncode}:\n{log_tail(log)}"
                )
        if time.monotonic() > deadline:
            raise BenchError(f"workers did not finish within {limit_s:.0f}s")
        time.sleep(0.1)
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        if proc.returncode != 0:
            raise BenchError(f"worker rank {rank} exited with {proc.returncode}:\n{log_tail(log)}")


def run_side(side: str, quick: bool, cpus: Pinning, workdir: Path, tag: str) -> Results:
    """Run one framework's two workers to completion; returns rank 0's results."""
    out = workdir / f"{side}-{tag}.json"
    logs = [workdir / f"{side}-{tag}-rank{rank}.log" for rank in (0, 1)]
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        for rank in (0, 1):
            procs.append(
                spawn_worker(side, rank, port, out=out, quick=quick, cpu=cpus[rank], log=logs[rank])
            )
        wait_all(procs, logs, SIDE_LIMIT_S["quick" if quick else "full"])
    finally:
        stop(procs)
    for rank, log in enumerate(logs):
        if tail := log_tail(log):
            print(f"[{side} rank {rank} output]\n{tail}", file=sys.stderr)
    results: Results = json.loads(out.read_text())
    results["wall_s"] = time.monotonic() - started
    return results


def run_rounds(
    sides: list[str], rounds: int, quick: bool, cpus: Pinning
) -> dict[str, list[Results]]:
    """Alternate the sides, one pair of fresh processes at a time, ``rounds`` times."""
    raw: dict[str, list[Results]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench_rpc-") as tmp:
        for index in range(rounds):
            for side in sides:
                result = run_side(side, quick, cpus, Path(tmp), f"round{index}")
                raw[side].append(result)
                print(
                    f"round {index + 1}/{rounds}: {side} done in {result['wall_s']:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
    return raw


# -- combining rounds -----------------------------------------------------------------


def round_median(rounds: list[Results], *keys: str) -> float:
    """The median over rounds of one measurement's per-round median."""
    values = []
    for result in rounds:
        value: Any = result
        for key in keys:
            value = value[key]
        values.append(float(value["median"]))
    return median(values)


def combine(side: str, rounds: list[Results]) -> Results:
    """One number per workload: medians over rounds; memory growth: the worst round."""
    combined: Results = {
        "noop_us": round_median(rounds, "noop_us"),
        "remote_to_here_us": round_median(rounds, "remote_to_here_us"),
        "rref_method_us": round_median(rounds, "rref_method_us"),
        "model_parallel_step_us": round_median(rounds, "model_parallel_step_us"),
        "pipelined_calls_per_s": round_median(rounds, "pipelined_calls_per_s"),
        "echo_ms": {mb: round_median(rounds, "echo_ms", mb) for mb in rounds[0]["echo_ms"]},
        "memory": {key: max(r["memory"][key] for r in rounds) for key in rounds[0]["memory"]},
    }
    if side == "asyncrpc":
        combined["coroutine_noop_us"] = round_median(rounds, "coroutine_noop_us")
        return combined
    plain = combined["noop_us"]
    future = combined["async_execution_noop_us"] = round_median(rounds, "async_execution_noop_us")
    combined["coroutine_noop_us"] = min(plain, future)
    combined["coroutine_noop_via"] = "async_execution" if future < plain else "plain noop"
    return combined


# -- the table ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    torch: str
    asyncrpc: str
    ratio: float | None
    target: str
    met: bool | None


def pick(results: Results | None, *keys: str) -> float | None:
    value: Any = results
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value)


def fmt(value: float | None, form: Callable[[float], str]) -> str:
    return "—" if value is None else form(value)


def speed_row(
    name: str,
    torch_v: float | None,
    arpc_v: float | None,
    *,
    unit: str,
    target: float,
    higher_is_better: bool = False,
) -> Row:
    forms: dict[str, Callable[[float], str]] = {
        "µs": lambda v: f"{v:,.1f} µs",
        "ms": lambda v: f"{v:,.2f} ms",
        "calls/s": lambda v: f"{v:,.0f} calls/s",
    }
    ratio = None
    if torch_v is not None and arpc_v is not None:
        ratio = arpc_v / torch_v if higher_is_better else torch_v / arpc_v
    met = None if ratio is None else ratio >= target
    form = forms[unit]
    return Row(name, fmt(torch_v, form), fmt(arpc_v, form), ratio, f"≥ {target}{TIMES}", met)


def memory_row(torch_r: Results | None, arpc_r: Results | None) -> Row:
    size = pick(arpc_r, "memory", "size_mb") or pick(torch_r, "memory", "size_mb") or 0.0
    torch_v = pick(torch_r, "memory", "receive_growth_mb")
    arpc_v = pick(arpc_r, "memory", "receive_growth_mb")
    ratio = arpc_v / size if arpc_v is not None and size else None
    judged = ratio is not None and size >= MEMORY_JUDGED_FROM_MB
    met = ratio <= MEMORY_TARGET if judged and ratio is not None else None
    form: Callable[[float], str] = lambda v: f"{v:,.0f} MB"  # noqa: E731
    return Row(
        f"callee peak-RSS growth receiving {size:.0f} MB" if size else "callee memory",
        fmt(torch_v, form),
        fmt(arpc_v, form),
        ratio,
        f"≤ {MEMORY_TARGET}{TIMES} size",
        met,
    )


def build_rows(cfg: Config, torch_r: Results | None, arpc_r: Results | None) -> list[Row]:
    via = torch_r.get("coroutine_noop_via", "?") if torch_r else "?"
    rows = [
        speed_row(
            "no-op round trip",
            pick(torch_r, "noop_us"),
            pick(arpc_r, "noop_us"),
            unit="µs",
            target=2.5,
        ),
        speed_row(
            f"coroutine no-op round trip (torch: {via})",
            pick(torch_r, "coroutine_noop_us"),
            pick(arpc_r, "coroutine_noop_us"),
            unit="µs",
            target=5.0,
        ),
        speed_row(
            "remote + to_here round trip",
            pick(torch_r, "remote_to_here_us"),
            pick(arpc_r, "remote_to_here_us"),
            unit="µs",
            target=2.5,
        ),
        speed_row(
            "RRef proxy method call round trip",
            pick(torch_r, "rref_method_us"),
            pick(arpc_r, "rref_method_us"),
            unit="µs",
            target=2.5,
        ),
        speed_row(
            "model-parallel step",
            pick(torch_r, "model_parallel_step_us"),
            pick(arpc_r, "model_parallel_step_us"),
            unit="µs",
            target=2.0,
        ),
        speed_row(
            f"pipelined no-op, {cfg.window} in flight",
            pick(torch_r, "pipelined_calls_per_s"),
            pick(arpc_r, "pipelined_calls_per_s"),
            unit="calls/s",
            target=4.0,
            higher_is_better=True,
        ),
    ]
    for mb in cfg.sizes_mb:
        rows.append(
            speed_row(
                f"tensor echo {mb} MB",
                pick(torch_r, "echo_ms", str(mb)),
                pick(arpc_r, "echo_ms", str(mb)),
                unit="ms",
                target=2.0,
            )
        )
    rows.append(memory_row(torch_r, arpc_r))
    return rows


def render(rows: list[Row]) -> str:
    lines = [
        "| workload | torch.distributed.rpc | asyncrpc | ratio | target | met |",
        "|---|---:|---:|---:|---|:-:|",
    ]
    for row in rows:
        ratio = "—" if row.ratio is None else f"{row.ratio:.2f}{TIMES}"
        met = "" if row.met is None else ("✓" if row.met else "✗")
        lines.append(
            f"| {row.workload} | {row.torch} | {row.asyncrpc} | {ratio} | {row.target} | {met} |"
        )
    return "\n".join(lines)


def notes(combined: dict[str, Results | None], raw: dict[str, list[Results]]) -> list[str]:
    """Lines printed under the table: choices made and anything that looks wrong."""
    lines = []
    torch_r = combined["torch"]
    if torch_r:
        lines.append(
            f"torch's coroutine no-op stand-in: {torch_r['coroutine_noop_via']} "
            f"(plain noop {torch_r['noop_us']:.1f} µs, "
            f"async_execution {torch_r['async_execution_noop_us']:.1f} µs)"
        )
    for side in SIDES:
        memory = (combined[side] or {}).get("memory")
        if memory:
            lines.append(
                f"{side} callee peak-RSS growth over receiving and echoing its first "
                f"{memory['size_mb']} MB tensor: {memory['echo_growth_mb']:,.0f} MB"
            )
    for index, result in enumerate(raw.get("asyncrpc", [])):
        info = result.get("debug_info", {})
        leftovers = {
            "pending outgoing calls": info.get("pending_outgoing_calls"),
            "running incoming calls": info.get("running_incoming_calls"),
            "shared-memory segments in use": (info.get("shared_memory") or {}).get(
                "segments_in_use"
            ),
            "RRefs still held": info.get("user_rrefs"),
        }
        for what, count in leftovers.items():
            if count:
                lines.append(f"warning: asyncrpc round {index + 1} ended with {count} {what}")
    return lines


# -- main -----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "uvloop": metadata.version("uvloop"),
        "loop": "uvloop",
    }


def pinning(pin: str | None) -> Pinning:
    """CPUs for ranks 0 and 1: ``same`` shares one CPU, ``split`` gives each its own."""
    allowed = sorted(os.sched_getaffinity(0))
    if pin is None:
        return (None, None)
    if pin == "same":
        return (allowed[0], allowed[0])
    if len(allowed) < 2:
        raise BenchError("--pin split needs two CPUs")
    return (allowed[0], allowed[1])


def describe(cpus: Pinning) -> str:
    return "unpinned" if cpus == (None, None) else f"{cpus[0]}/{cpus[1]}"


def load_average() -> float:
    return os.getloadavg()[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="small counts and tensors up to 4 MB (smoke test)"
    )
    parser.add_argument("--only", choices=SIDES, help="run one framework only (for profiling)")
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="fresh process pairs per framework, alternating (default 5; quick 1)",
    )
    parser.add_argument(
        "--pin",
        choices=("same", "split"),
        help="bind both workers to one CPU, or each to its own (default: let the OS place them)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw numbers here")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def exit_on_sigterm(signum: int, frame: object) -> None:
    """Turn SIGTERM into SystemExit, so that ``run_side`` still kills its workers."""
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    cfg = config(args.quick)
    mode = "quick" if args.quick else "full"
    info = machine()
    load_before = load_average()
    print(
        f"machine: {info['cpus']} CPUs ({info['cpu_model']}), Python {info['python']}, "
        f"torch {info['torch']}, asyncrpc loop = uvloop {info['uvloop']}",
        flush=True,
    )
    sides = [side for side in SIDES if args.only in (None, side)]
    cpus = pinning(args.pin)
    raw = run_rounds(sides, args.rounds, args.quick, cpus)
    combined = {side: combine(side, raw[side]) if side in raw else None for side in SIDES}
    rows = build_rows(cfg, combined["torch"], combined["asyncrpc"])
    load_after = load_average()
    print(
        f"\nmode: {mode}, {args.rounds} round(s) per framework (median over rounds), "
        f"CPUs of ranks 0/1: {describe(cpus)}, "
        f"1-min load average {load_before:.2f} before / {load_after:.2f} after\n"
    )
    print(render(rows))
    print("\n".join(["", *notes(combined, raw)]))
    if args.json:
        payload = {
            "machine": info,
            "mode": mode,
            "rounds": args.rounds,
            "cpus": list(cpus),
            "config": cfg.as_dict(),
            "load_average": [load_before, load_after],
            "combined": combined,
            "raw": raw,
            "rows": [asdict(row) for row in rows],
        }
        args.json.write_text(json.dumps(payload, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
