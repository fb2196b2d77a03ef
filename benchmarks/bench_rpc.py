"""Speed benchmark: asyncrpc against torch.distributed.rpc (TensorPipe) on one host.

What it measures
----------------
Each workload runs in fresh worker processes talking over loopback (``veth``: across
a veth link between two network namespaces): the last rank, ``server``, serves; the
others (``w0``, ...) call it.  Only one job (one set of processes) runs at a time, so
the frameworks never compete for cores: each job runs for torch, then for asyncrpc,
before the next job starts, and a round is one pass over every job.  A full run does
five rounds (``--rounds``), so that background load hits both alike; on a shared VM
a whole round can land in a slow spell (round medians of one workload have differed
by 2x within a run), hence five.  Each workload warms up first unless it measures the
cold start; a row reports the median over rounds of each round's median.  Every
worker runs with ``OMP_NUM_THREADS=1``, as torchrun sets for multi-process jobs.
MB = 2**20 bytes.

One pair per round runs rows 1 to 8 (``--workloads calls``):

1. no-op round trip: ``noop()`` (a plain function, run in the callee's thread
   pool) called sequentially; per round, the median over batches of the mean
   time per call.
2. coroutine no-op round trip: asyncrpc calls ``async def coro_noop()``, which
   runs on the callee's event loop.  torch cannot run coroutines, so its number
   is the faster of its plain no-op and an ``@rpc.functions.async_execution``
   function returning an already-completed Future (the row says which).
3. remote + to_here round trip: ``rref = remote(server, add, args=(1, 2))`` then
   ``await rref.to_here()`` (torch: ``rpc.remote`` then the blocking
   ``to_here()``), sequentially, timed like row 1.  The RRef is dropped after
   each iteration, so its cost includes both frameworks' delete message to the
   owner (sent in the background, but it shares the link and the callee).
4. RRef proxy method call round trip: one ``rref = remote(server, Box)`` made up
   front, then ``await rref.rpc_async().get()`` (torch:
   ``rref.rpc_async().get().wait()``), a plain method returning a small int,
   sequentially, timed like row 1.
5. model-parallel step: one SGD training step (lr 0.01) of an MLP split over
   the pair, on a fixed 32 x 256 float32 batch with fixed labels.  Stage 1
   (Linear(256, 256) + ReLU) is a local module on ``w0``; stage 2 (Linear(256,
   256) + ReLU + Linear(256, 10)) is a ``Stage2`` made once on the server with
   ``remote()``.  Each step opens a distributed autograd context, runs stage 1,
   then ``await stage2.rpc_async().forward(h)`` (torch: ``rpc_sync()``), takes
   the cross-entropy loss, runs the distributed backward, and steps a
   ``DistributedOptimizer`` over both stages' parameter RRefs (asyncrpc's, or
   ``torch.distributed.optim``'s), then leaves the context.  Sequential steps,
   timed like row 1 (smaller counts); the loss must fall over the run.
5b. state dict push: a model's state dict (50 blocks of Conv2d(16, 16, 3) and
   BatchNorm2d(16): 300 tensors, 0.5 MB, an OrderedDict as ``state_dict()`` gives
   it) sent to a plain function that answers how many tensors it got, as a
   parameter server is pushed gradients; timed like row 5.  No target: the row
   shows the cost of many tensors in one message, per tensor on both sides.
6. pipelined no-op: ``noop()`` with 256 calls in flight at all times; calls per
   second over 20,000 calls.  Then row 1 again, in the same pair: the no-op round
   trip after that burst (which grows a callee's thread pool), as a worker's
   calls come after a fan-out.
7. tensor echo: ``echo(x)`` returns its float32 argument of 4, 64 and 400 MB;
   each result is dropped before the next call; round-trip time after two
   warm-up echoes (the first one's result is checked).
8. memory: growth of the callee's peak RSS (``ru_maxrss``) while it receives
   the largest tensor, before any other large transfer in that process pair
   (the worst round counts).  The target is about the tensor's own size: at
   most 1.1 times it, judged from 64 MB up.

The other workloads, each in processes of its own:

9. first echo of a fresh pair (``cold``; one pair per size and round): the
   caller makes one no-op call (it opens the connection), then echoes a 4, 64
   or 400 MB tensor: the first tensor either process moves, which pays for
   creating its buffers or segments and touching their pages for the first
   time.  One sample per round.
10. steady echo with the previous result alive (``steady``): as row 7, but each
    result stays referenced until the next one has arrived, as users write
    ``prev = await rpc_async(...)``.
11. bandwidth curve (``bandwidth``): the echo of row 7 at 1 KB, 4 KB, ... 1 GB
    (powers of 4; ``--skip-1g`` stops at 256 MB), each size after two warm-up
    echoes, timed min(200, max(3, 1 GB / size)) times.  GB/s counts the bytes
    both ways: 2 x size / round trip, GB = 10**9 bytes.
12. 1 server + N clients (``fanin``; N = 1, 2, 4, 8, one set of N + 1 fresh
    processes per N; torch: ``world_size`` N + 1, ``init_rpc`` in each): every
    client keeps 64 ``noop()`` calls in flight; after 500 warm-up calls, three
    timed windows of 4,000 calls per client, each started when all clients have
    met in ``rendezvous()`` on the server.  The server's rate: all clients'
    calls / (last client's end - first client's start), on the host's monotonic
    clock.  A second row: each framework's total at the largest N over its
    total at N = 1.
13. spread of the no-op round trip (``spread``): six fresh pairs per framework,
    one per round (rounds past ``--rounds`` run this job alone); each times
    2,000 single ``noop()`` calls after 500 warm-up calls.  The row gives the
    smallest and largest p50 over the pairs and their ratio.
14. both frameworks forced onto TCP (``tcp``; one fresh pair per size and round):
    asyncrpc with ``transports=("tcp",), shared_memory=False``, torch's TensorPipe
    with ``_transports=["uv"], _channels=["basic"]``; the first echo of a 4, 64 or
    400 MB tensor (after a no-op), then steady echoes of it as row 10 (target 1.5x
    at 64 and 400 MB).  ``benchmarks/tcp_floor.py`` gives a raw socket's figures
    for the same echo.
15. the same across a veth link (``veth``; one fresh pair per size and round): as
    row 14, but the two processes run in two network namespaces joined by one veth
    pair (made for the job, deleted after it; ``benchmarks/_veth.py``), so the bytes
    cross a veth link, as between containers or pods of one host, instead of
    loopback.  The rendezvous is at the caller's address; asyncrpc listens on the
    address that routes to it, TensorPipe on the interface ``TP_SOCKET_IFNAME``
    names (the namespace's end of the pair).  Same target as row 14.  It needs root
    and iproute2's ``ip``: where namespaces cannot be made, the run says so once and
    goes on without these rows.  ``tcp_floor.py --veth`` gives a raw socket's
    figures across such a pair.

The floor
---------
Beside the two frameworks, a third side runs the ``calls``, ``fanin`` and ``spread``
jobs of each round: the *floor* (``_floor_worker.py``), the least a Python RPC does per
call, over the skeleton RPC of ``_skeleton.py`` (a pickled call in a length-prefixed
frame, a future per call id, a pool thread for a plain function and a task for a
coroutine, the pickled result back; no authentication, limits, deadlines, metrics or
errors).  It times the plain, coroutine and pipelined no-ops, the N-client fan-in and
the spread as the frameworks' workers do, and the model-parallel step over the skeleton
(its three round trips, tensors as numpy arrays in the pickles, autograd by hand at
each end), with a row for the step's compute alone (both stages in one process, no
RPC) beside it.  A second pair of tables gives
torch against the floor with the same targets: a target the floor misses in a round
was out of any such framework's reach in that round, and the gap between asyncrpc and
the floor is asyncrpc's own work.

How to read it
--------------
``ratio`` is how many times better asyncrpc does: torch time / asyncrpc time
for latencies, asyncrpc rate / torch rate for throughput; ``target`` is the
ratio asyncrpc must reach.  A target is met (``met``: ✓) when it holds for the
medians over rounds and in at least 4 of 5 rounds alone (80% of the rounds);
the column says in how many rounds it held.  With fewer than five rounds the
mark is in parentheses: indicative only.  For the memory row the ratio is
asyncrpc's growth divided by the tensor size; for the spread row, asyncrpc's
largest p50 over its smallest (at most 1.3).  A second table gives every row's
values and ratio per round.  Notes under the tables name torch's coroutine
stand-in, the callee's growth over a whole echo, and calls, shared-memory
segments or RRefs asyncrpc still held at the end.  Small machines are noisy
(the load average is printed): compare runs on the same machine, and look at
the per-sample numbers in the JSON file.  On small VMs, waking a process on
another vCPU can cost more than the RPC itself, and where the OS places the
workers varies from run to run; ``--pin same`` or ``--pin split`` fixes the
placement (one shared CPU, or one CPU for the callers and one for the server).

Everything goes to a JSON file (``--json``, default
``benchmarks/results/latest.json``; ``quick.json`` with ``--quick``) and the
bandwidth curve and N-client scaling to a PNG beside it (``--plot``).  A job
that fails stops the run, but the rounds done so far are still reported.

Usage: ``python benchmarks/bench_rpc.py [--quick] [--only torch|asyncrpc|floor]
[--rounds N] [--workloads calls,cold,steady,bandwidth,fanin,spread,tcp,veth] [--skip-1g]
[--pin same|split] [--json PATH] [--plot PATH]``.  ``--quick`` (one round, small
counts, tensors up to 4 MB, up to 2 clients, 2 pairs for the spread: a minute
or two) is the smoke test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from itertools import zip_longest
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # also importable as ``python -m benchmarks.bench_rpc``
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import (  # noqa: E402
    GB,
    MB,
    WORKLOADS,
    Config,
    Results,
    config,
    median,
    pyplot,
    results_path,
    size_label,
    summary,
)
from _floor_worker import WORKLOADS as FLOOR_WORKLOADS  # noqa: E402
from _veth import Namespace, VethUnavailableError, veth_pair, wrap  # noqa: E402

from asyncrpc.rendezvous import free_port  # noqa: E402

SIDES = ("torch", "asyncrpc", "floor")
"""Who runs each job: both frameworks, then the floor (a skeleton Python RPC), which
runs only the jobs in ``FLOOR_WORKLOADS``."""
FRAMEWORKS = ("torch", "asyncrpc")
LABELS = {"torch": "torch.distributed.rpc", "asyncrpc": "asyncrpc", "floor": "floor"}
WORKERS = {
    "torch": HERE / "_torch_worker.py",
    "asyncrpc": HERE / "_asyncrpc_worker.py",
    "floor": HERE / "_floor_worker.py",
}
RESULTS = HERE / "results"
JOB_LIMIT_S = {"quick": 90.0, "full": 300.0}
TIMES = "\N{MULTIPLICATION SIGN}"
MEMORY_TARGET = 1.1
MEMORY_JUDGED_FROM_MB = 64  # below this, allocator and page noise swamp the tensor itself
JUDGED_FROM_ROUNDS = 5
ROUND_SHARE = 0.8
"""A target must also hold in this share of the rounds alone (4 of 5)."""
LOG_TAIL_LINES = 20


Pinning = tuple[int | None, int | None]
"""The CPU of the calling ranks and of the server (None: wherever the OS schedules it)."""
Raw = dict[str, dict[str, list[Results]]]
"""Per framework, per job key, one result per round (in round order)."""


class BenchError(RuntimeError):
    """A worker failed or overran its time limit."""


# -- jobs: fresh processes running one workload ----------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One workload in ``clients`` + 1 fresh processes (the last one serves)."""

    workload: str
    clients: int = 1
    size: int | None = None
    variant: str = ""

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.variant}" if self.variant else self.workload


def jobs_of(cfg: Config, workload: str, largest: int) -> list[Job]:
    """The jobs one round runs for ``workload``; ``largest`` caps the bandwidth curve."""
    if workload in ("cold", "tcp", "veth"):
        return [Job(workload, size=n, variant=size_label(n)) for n, _ in cfg.echo_sizes]
    if workload == "fanin":
        return [Job("fanin", clients=n, variant=str(n)) for n in cfg.fanin_clients]
    if workload == "bandwidth":
        return [Job("bandwidth", size=largest)]
    return [Job(workload)]


def schedule(cfg: Config, workloads: Sequence[str], rounds: int, largest: int) -> list[list[Job]]:
    """The jobs of each round: every workload ``rounds`` times, the spread's pairs
    ``cfg.spread_pairs`` times (in extra rounds of their own if need be)."""
    times = {w: cfg.spread_pairs if w == "spread" else rounds for w in workloads}
    return [
        [job for w in workloads if index < times[w] for job in jobs_of(cfg, w, largest)]
        for index in range(max(times.values()))
    ]


# -- running one job ------------------------------------------------------------------


# One intra-op thread per worker process, for both frameworks: what torchrun sets for
# multi-process jobs (OMP_NUM_THREADS=1), and two processes share this host's cores.
WORKER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


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


def spawn_worker(
    side: str,
    job: Job,
    rank: int,
    port: int,
    *,
    out: Path,
    quick: bool,
    cpu: int | None,
    spaces: Sequence[Namespace] = (),
) -> subprocess.Popen[bytes]:
    """Rank ``rank`` of ``job``; with ``spaces`` (``veth``), in namespace ``spaces[rank]``,
    the rendezvous at ``spaces[0]``'s address."""
    command = [sys.executable, str(WORKERS[side]), str(rank), str(port), str(out)]
    command += [f"--world-size={job.clients + 1}", f"--workload={job.workload}"]
    if job.size is not None:
        command.append(f"--size={job.size}")
    if quick:
        command.append("--quick")
    if cpu is not None:
        command.append(f"--cpu={cpu}")
    env = WORKER_ENV
    if spaces:
        command = wrap(spaces[rank], [*command, f"--host={spaces[0].address}"])
        # torch listens on the hostname's address (loopback here) unless told the
        # interface: TensorPipe's uv transport, and the Gloo group its init_rpc makes;
        # asyncrpc picks the address that routes to --host.
        veth = spaces[rank].veth
        env = {**WORKER_ENV, "TP_SOCKET_IFNAME": veth, "GLOO_SOCKET_IFNAME": veth}
    with log_path(out, rank).open("wb") as sink:
        return subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def log_path(out: Path, rank: int) -> Path:
    return out / f"rank{rank}.log"


def merge(job: Job, results: list[Results]) -> Results:
    """One result per job: the caller's, or for ``fanin`` the server's rate and all clients'."""
    if job.workload != "fanin":
        return results[0]
    calls = sum(r["calls"] for r in results)
    rates = [
        calls / ((max(end for _, end in spans) - min(start for start, _ in spans)) / 1e9)
        for spans in zip(*(r["spans_ns"] for r in results), strict=True)
    ]
    return {"calls_per_s": summary(rates), "clients": results}


def run_job(side: str, job: Job, quick: bool, cpus: Pinning, out: Path) -> Results:
    """Run one framework's processes for ``job`` to completion, in the folder ``out``
    (``veth``: in two fresh namespaces joined by a veth pair, deleted after the job)."""
    out.mkdir(parents=True)
    started = time.monotonic()
    if job.workload == "veth":
        try:
            with veth_pair() as spaces:
                run_processes(side, job, quick, cpus, out, spaces)
        except VethUnavailableError as exc:
            raise BenchError(f"cannot make the veth pair: {exc}") from exc
    else:
        run_processes(side, job, quick, cpus, out)
    result = merge(job, [json.loads(results_path(out, r).read_text()) for r in range(job.clients)])
    result["wall_s"] = time.monotonic() - started
    return result


def run_processes(
    side: str, job: Job, quick: bool, cpus: Pinning, out: Path, spaces: Sequence[Namespace] = ()
) -> None:
    """Start ``job``'s processes (rank r in ``spaces[r]`` if given), wait for all to
    exit 0, kill what still runs, and print the tail of each one's output."""
    world = job.clients + 1
    logs = [log_path(out, rank) for rank in range(world)]
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            cpu = cpus[1] if rank == world - 1 else cpus[0]
            procs.append(
                spawn_worker(side, job, rank, port, out=out, quick=quick, cpu=cpu, spaces=spaces)
            )
        wait_all(procs, logs, JOB_LIMIT_S["quick" if quick else "full"])
    finally:
        stop(procs)
    for rank, log in enumerate(logs):
        if tail := log_tail(log):
            print(f"[{side} {job.key} rank {rank} output]\n{tail}", file=sys.stderr)


def run_rounds(
    sides: list[str], plan: list[list[Job]], quick: bool, cpus: Pinning
) -> tuple[Raw, str | None]:
    """Run each round's jobs, each for every side in turn; returns what was measured and
    the failure that stopped the run early, if one did."""
    raw: Raw = {side: {} for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench_rpc-") as tmp:
        for index, jobs in enumerate(plan):
            for job in jobs:
                for side in sides:
                    if side == "floor" and job.workload not in FLOOR_WORKLOADS:
                        continue
                    tag = f"{side}-{job.key.replace('/', '-')}-round{index}"
                    try:
                        result = run_job(side, job, quick, cpus, Path(tmp) / tag)
                    except BenchError as exc:
                        return raw, f"{side} {job.key}, round {index + 1}: {exc}"
                    raw[side].setdefault(job.key, []).append(result)
                    print(
                        f"round {index + 1}/{len(plan)}: {side} {job.key} "
                        f"done in {result['wall_s']:.0f}s",
                        file=sys.stderr,
                        flush=True,
                    )
    return raw, None


# -- per-round values, targets and rows -------------------------------------------------

Extract = Callable[[Results], float]
Ratio = Callable[[float | None, float | None], float | None]
Form = Callable[[float], str]


def at(*path: str) -> Extract:
    """The number at ``path`` in one job's result: a measurement's median, or the number."""

    def extract(result: Results) -> float:
        value: Any = result
        for key in path:
            value = value[key]
        return float(value["median"]) if isinstance(value, dict) else float(value)

    return extract


def per_round(raw: Raw, side: str, key: str, extract: Extract) -> list[float]:
    return [extract(result) for result in raw.get(side, {}).get(key, [])]


def both(
    raw: Raw,
    key: str,
    extract: Extract,
    torch_extract: Extract | None = None,
    *,
    side: str = "asyncrpc",
) -> tuple[list[float], list[float]]:
    """Per-round values of torch and of ``side`` (asyncrpc, or the floor)."""
    torch_v = per_round(raw, "torch", key, torch_extract or extract)
    return torch_v, per_round(raw, side, key, extract)


def ran(raw: Raw, key: str) -> bool:
    return any(key in jobs for jobs in raw.values())


def speedup(torch_v: float | None, arpc_v: float | None) -> float | None:
    """For times: how many times less asyncrpc takes."""
    return None if torch_v is None or arpc_v is None else torch_v / arpc_v


def gain(torch_v: float | None, arpc_v: float | None) -> float | None:
    """For rates: how many times more asyncrpc does."""
    return None if torch_v is None or arpc_v is None else arpc_v / torch_v


def own(torch_v: float | None, arpc_v: float | None) -> float | None:
    """For a figure of asyncrpc's alone (torch's is shown beside it, not compared)."""
    return arpc_v


@dataclass(frozen=True, slots=True)
class Target:
    bound: float
    at_most: bool = False

    def holds(self, ratio: float) -> bool:
        return ratio <= self.bound if self.at_most else ratio >= self.bound

    def __str__(self) -> str:
        return f"{'≤' if self.at_most else '≥'} {self.bound:g}{TIMES}"


FLOOR_TITLE = (
    "The floor, in the same rounds: the least a Python RPC does per call (a skeleton RPC, "
    "benchmarks/_skeleton.py;\nbeside it the step's compute alone, both stages in one "
    "process), against torch. A target the floor misses was out of any Python RPC's reach "
    "here."
)

# The targets (ratios asyncrpc must reach; see the module docstring).
NOOP, COROUTINE, REMOTE, RREF_METHOD, STEP = (Target(b) for b in (4, 8, 2.5, 2.5, 2))
PIPELINED, ECHO, BANDWIDTH, FANIN, SCALING = (Target(b) for b in (10, 2, 2, 3, 1))
COLD = {400: Target(1.5)}
STEADY = {4: Target(3), 64: Target(5), 400: Target(8)}
TCP = {64: Target(1.5), 400: Target(1.5)}
SPREAD = Target(1.3, at_most=True)
SPREAD_JUDGED_FROM_PAIRS = 6


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    torch: str
    asyncrpc: str
    ratio: float | None
    target: str
    met: bool | None
    held: str
    """In how many rounds (or pairs) the target held."""
    judged: bool
    """Enough rounds to judge the target (else ``met`` is only indicative)."""
    torch_rounds: list[float]
    asyncrpc_rounds: list[float]
    round_ratios: list[float | None]


def fmt(value: float | None, form: Form) -> str:
    return "—" if value is None else form(value)


def compare(
    name: str,
    values: tuple[list[float], list[float]],
    *,
    form: Form,
    target: Target | None,
    ratio_of: Ratio = speedup,
    overall: Callable[[list[float]], float] = median,
) -> Row:
    """A row from per-round values: ``overall`` of each side's rounds (the median, by
    default), their ratio, and whether ``target`` holds in it and in enough rounds."""
    torch_v, arpc_v = values
    torch_all = overall(torch_v) if torch_v else None
    arpc_all = overall(arpc_v) if arpc_v else None
    ratio = ratio_of(torch_all, arpc_all)
    ratios = [ratio_of(t, a) for t, a in zip_longest(torch_v, arpc_v)]
    judged = [r for r in ratios if r is not None]
    met, held = None, ""
    if target is not None and ratio is not None and judged:
        hits = sum(target.holds(r) for r in judged)
        met = target.holds(ratio) and hits >= math.ceil(ROUND_SHARE * len(judged))
        held = f"{hits}/{len(judged)} rounds"
    return Row(
        name,
        fmt(torch_all, form),
        fmt(arpc_all, form),
        ratio,
        str(target or ""),
        met,
        held,
        len(judged) >= JUDGED_FROM_ROUNDS,
        torch_v,
        arpc_v,
        ratios,
    )


def us(v: float) -> str:
    return f"{v:,.1f} µs"


def ms(v: float) -> str:
    return f"{v:,.2f} ms"


def per_s(v: float) -> str:
    return f"{v:,.0f} calls/s"


def factor(v: float) -> str:
    return f"{v:.2f}{TIMES}"


def gb_per_s(nbytes: int, ms_per_echo: float) -> float:
    """Bytes both ways per second, in GB (10**9 bytes)."""
    return 2 * nbytes / (ms_per_echo / 1e3) / 1e9


def bandwidth_form(nbytes: int) -> Form:
    return lambda v: f"{v:,.3f} ms, {gb_per_s(nbytes, v):.2f} GB/s"


def torch_coroutine(result: Results) -> float:
    """torch's coroutine stand-in in one round: the faster of its two no-ops."""
    return min(at("noop_us")(result), at("async_execution_noop_us")(result))


def calls_rows(cfg: Config, raw: Raw, side: str = "asyncrpc") -> list[Row]:
    """The ``calls`` rows of torch against ``side``: asyncrpc's, or the floor's (the
    rows it has a figure for)."""
    via = (combine_torch_calls(raw) or {}).get("coroutine_noop_via", "?")
    rows: list[tuple[str, str, Extract | None, Form, Target | None, Ratio]] = [
        ("no-op round trip", "noop_us", None, us, NOOP, speedup),
        (
            f"coroutine no-op round trip (torch: {via})",
            "coroutine_noop_us",
            torch_coroutine,
            us,
            COROUTINE,
            speedup,
        ),
        ("remote + to_here round trip", "remote_to_here_us", None, us, REMOTE, speedup),
        ("RRef proxy method call round trip", "rref_method_us", None, us, RREF_METHOD, speedup),
        ("model-parallel step", "model_parallel_step_us", None, us, STEP, speedup),
        (
            "state dict push (300 tensors, 0.5 MB)",
            "state_dict_push_us",
            None,
            us,
            None,
            speedup,
        ),
        (
            "model-parallel step's compute alone (no RPC)",
            "step_compute_us",
            at("model_parallel_step_us"),
            us,
            None,
            speedup,
        ),
        (
            f"pipelined no-op, {cfg.window} in flight",
            "pipelined_calls_per_s",
            None,
            per_s,
            PIPELINED,
            gain,
        ),
        (
            f"no-op round trip, after {cfg.window} in flight",
            "noop_after_burst_us",
            None,
            us,
            NOOP,
            speedup,
        ),
    ]
    measured = raw.get(side, {}).get("calls", [])
    compared = [
        compare(
            name,
            both(raw, "calls", at(key), torch_extract, side=side),
            form=form,
            target=target,
            ratio_of=ratio_of,
        )
        for name, key, torch_extract, form, target, ratio_of in rows
        if all(key in result for result in measured)
    ]
    if side != "asyncrpc":
        return compared
    compared += [
        compare(
            f"tensor echo {mb} MB",
            both(raw, "calls", at("echo_ms", str(mb))),
            form=ms,
            target=ECHO,
        )
        for mb in cfg.sizes_mb
    ]
    return [*compared, memory_row(cfg, raw)]


def memory_row(cfg: Config, raw: Raw) -> Row:
    size = max(cfg.sizes_mb)

    def share(torch_v: float | None, arpc_v: float | None) -> float | None:
        return None if arpc_v is None else arpc_v / size

    return compare(
        f"callee peak-RSS growth receiving {size} MB",
        both(raw, "calls", at("memory", "receive_growth_mb")),
        form=lambda v: f"{v:,.0f} MB",
        target=Target(MEMORY_TARGET, at_most=True) if size >= MEMORY_JUDGED_FROM_MB else None,
        ratio_of=share,
        overall=max,  # the worst round counts
    )


def cold_rows(cfg: Config, raw: Raw) -> list[Row]:
    return [
        compare(
            f"first echo {nbytes // MB} MB of a fresh pair",
            both(raw, f"cold/{size_label(nbytes)}", at("first_echo_ms")),
            form=ms,
            target=COLD.get(nbytes // MB),
        )
        for nbytes, _ in cfg.echo_sizes
        if ran(raw, f"cold/{size_label(nbytes)}")
    ]


def steady_rows(cfg: Config, raw: Raw) -> list[Row]:
    if not ran(raw, "steady"):
        return []
    return [
        compare(
            f"steady echo {mb} MB, previous result alive",
            both(raw, "steady", at("echo_ms", str(mb))),
            form=ms,
            target=STEADY.get(mb),
        )
        for mb in cfg.sizes_mb
    ]


def tcp_rows(cfg: Config, raw: Raw, workload: str = "tcp", label: str = "tcp only") -> list[Row]:
    """Both frameworks forced onto TCP: the first echo of a fresh pair, then steady
    (``workload`` ``veth``: across a veth pair)."""
    rows = []
    for nbytes, _ in cfg.echo_sizes:
        key, mb = f"{workload}/{size_label(nbytes)}", nbytes // MB
        if ran(raw, key):
            rows.append(
                compare(
                    f"{label}: first echo {mb} MB",
                    both(raw, key, at("first_echo_ms")),
                    form=ms,
                    target=None,
                )
            )
            rows.append(
                compare(
                    f"{label}: steady echo {mb} MB",
                    both(raw, key, at("echo_ms")),
                    form=ms,
                    target=TCP.get(mb),
                )
            )
    return rows


def bandwidth_sizes(cfg: Config, raw: Raw) -> list[int]:
    """The sizes of the bandwidth curve that were measured."""
    first = next((jobs["bandwidth"][0] for jobs in raw.values() if "bandwidth" in jobs), {})
    return [nbytes for nbytes in cfg.bandwidth_sizes if size_label(nbytes) in first]


def bandwidth_rows(cfg: Config, raw: Raw) -> list[Row]:
    return [
        compare(
            f"bandwidth curve: echo {size_label(nbytes)}",
            both(raw, "bandwidth", at(size_label(nbytes))),
            form=bandwidth_form(nbytes),
            target=BANDWIDTH,
        )
        for nbytes in bandwidth_sizes(cfg, raw)
    ]


def fanin_counts(cfg: Config, raw: Raw) -> list[int]:
    return [n for n in cfg.fanin_clients if ran(raw, f"fanin/{n}")]


def scaling(raw: Raw, side: str, low: int, high: int) -> list[float]:
    """Per round: ``side``'s total rate with ``high`` clients over that with ``low``."""
    lows = per_round(raw, side, f"fanin/{low}", at("calls_per_s"))
    highs = per_round(raw, side, f"fanin/{high}", at("calls_per_s"))
    return [h / lo for lo, h in zip(lows, highs, strict=False)]


def fanin_rows(cfg: Config, raw: Raw, side: str = "asyncrpc") -> list[Row]:
    counts = fanin_counts(cfg, raw)
    rows = [
        compare(
            f"1 server + {n} client{'s' if n > 1 else ''}, {cfg.fanin_window} in flight each",
            both(raw, f"fanin/{n}", at("calls_per_s"), side=side),
            form=per_s,
            target=FANIN,
            ratio_of=gain,
        )
        for n in counts
    ]
    if len(counts) > 1:
        low, high = counts[0], counts[-1]
        rows.append(
            compare(
                f"server total, {high} clients over {low} (each framework's own)",
                (scaling(raw, "torch", low, high), scaling(raw, side, low, high)),
                form=factor,
                target=SCALING,
                ratio_of=own,
            )
        )
    return rows


def spread_row(raw: Raw, side: str = "asyncrpc") -> list[Row]:
    if not ran(raw, "spread"):
        return []
    torch_v, arpc_v = both(raw, "spread", at("noop_us", "p50"), side=side)

    def cell(values: list[float]) -> str:
        if not values:
            return "—"
        low, high = min(values), max(values)
        return f"{low:,.1f} to {high:,.1f} µs ({high / low:.2f}{TIMES})"

    ratio = max(arpc_v) / min(arpc_v) if arpc_v else None
    pairs = max(len(torch_v), len(arpc_v))
    return [
        Row(
            f"p50 no-op round trip over {pairs} fresh pairs: min to max (max/min)",
            cell(torch_v),
            cell(arpc_v),
            ratio,
            str(SPREAD),
            None if ratio is None else SPREAD.holds(ratio),
            f"{len(arpc_v)} pairs",
            len(arpc_v) >= SPREAD_JUDGED_FROM_PAIRS,
            torch_v,
            arpc_v,
            [],
        )
    ]


def build_rows(cfg: Config, raw: Raw) -> list[Row]:
    rows = calls_rows(cfg, raw) if ran(raw, "calls") else []
    rows += cold_rows(cfg, raw) + steady_rows(cfg, raw) + tcp_rows(cfg, raw)
    rows += tcp_rows(cfg, raw, "veth", "veth")
    rows += bandwidth_rows(cfg, raw)
    return rows + fanin_rows(cfg, raw) + spread_row(raw)


def floor_rows(cfg: Config, raw: Raw) -> list[Row]:
    """torch against the floor: a skeleton Python RPC's small calls, and the model-parallel
    step's compute with no RPC (``_floor_worker.py``), in the same rounds.  A target the
    floor misses in a run was out of reach of any Python RPC that runs plain functions
    in a thread pool, as torch does, on this machine then."""
    floor = raw.get("floor", {})
    rows = calls_rows(cfg, raw, "floor") if "calls" in floor else []
    if any(key.startswith("fanin/") for key in floor):
        rows += fanin_rows(cfg, raw, "floor")
    return rows + (spread_row(raw, "floor") if "spread" in floor else [])


def compact(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def met_cell(row: Row) -> str:
    if row.met is None:
        return ""
    mark = "✓" if row.met else "✗"
    return f"{mark if row.judged else f'({mark})'} {row.held}"


def render(rows: list[Row], side: str = "asyncrpc") -> str:
    lines = [
        f"| workload | torch.distributed.rpc | {LABELS[side]} | ratio | target | met |",
        "|---|---:|---:|---:|---|:-:|",
    ]
    for row in rows:
        ratio = "—" if row.ratio is None else f"{row.ratio:.2f}{TIMES}"
        lines.append(
            f"| {row.workload} | {row.torch} | {row.asyncrpc} | {ratio} | {row.target} "
            f"| {met_cell(row)} |"
        )
    return "\n".join(lines)


def render_rounds(rows: list[Row], side: str = "asyncrpc") -> str:
    """Every row's values and ratio, round by round (the spread row: pair by pair)."""
    lines = [
        f"| workload | torch per round | {LABELS[side]} per round | ratio per round |",
        "|---|---|---|---|",
    ]
    for row in rows:
        cells: list[Sequence[float | None]] = [
            row.torch_rounds,
            row.asyncrpc_rounds,
            row.round_ratios,
        ]
        text = [", ".join(compact(v) for v in values) or "—" for values in cells]
        lines.append(f"| {row.workload} | {' | '.join(text)} |")
    return "\n".join(lines)


# -- what goes beside the table: combined numbers, curves, notes -----------------------


def round_median(rounds: list[Results], *keys: str) -> float:
    """The median over rounds of one measurement's per-round median."""
    return median([at(*keys)(result) for result in rounds])


def combine(side: str, rounds: list[Results]) -> Results:
    """The ``calls`` pair's numbers: medians over rounds; memory growth: the worst round."""
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


def combine_calls(raw: Raw) -> dict[str, Results]:
    """Both frameworks' ``calls`` numbers, combined over rounds (the floor's are rows)."""
    return {
        side: combine(side, jobs["calls"])
        for side, jobs in raw.items()
        if side in FRAMEWORKS and "calls" in jobs
    }


def combine_torch_calls(raw: Raw) -> Results | None:
    return combine_calls(raw).get("torch")


def curves(cfg: Config, raw: Raw) -> Results:
    """The plotted numbers, medians over rounds: GB/s per size, server calls/s per N."""
    sizes = bandwidth_sizes(cfg, raw)
    bandwidth = {
        side: [
            {
                "bytes": nbytes,
                "ms": (m := median(per_round(raw, side, "bandwidth", at(size_label(nbytes))))),
                "gb_per_s": gb_per_s(nbytes, m),
            }
            for nbytes in sizes
        ]
        for side, jobs in raw.items()
        if "bandwidth" in jobs
    }
    fanin = {
        side: [
            {
                "clients": n,
                "calls_per_s": median(per_round(raw, side, f"fanin/{n}", at("calls_per_s"))),
            }
            for n in fanin_counts(cfg, raw)
        ]
        for side, jobs in raw.items()
        if any(key.startswith("fanin/") for key in jobs)
    }
    return {"bandwidth": bandwidth, "fanin": fanin}


def notes(raw: Raw, rows: list[Row]) -> list[str]:
    """Lines printed under the tables: choices made and anything that looks wrong."""
    lines = []
    combined = combine_calls(raw)
    if torch_r := combined.get("torch"):
        lines.append(
            f"torch's coroutine no-op stand-in: {torch_r['coroutine_noop_via']} "
            f"(plain noop {torch_r['noop_us']:.1f} µs, "
            f"async_execution {torch_r['async_execution_noop_us']:.1f} µs)"
        )
    for side, result in combined.items():
        memory = result["memory"]
        lines.append(
            f"{side} callee peak-RSS growth over receiving and echoing its first "
            f"{memory['size_mb']} MB tensor: {memory['echo_growth_mb']:,.0f} MB"
        )
    for side, jobs in raw.items():
        firsts = [
            r["first_noop_ms"] for key, rs in jobs.items() if key.startswith("cold/") for r in rs
        ]
        if firsts:
            lines.append(
                f"{side}: first call of a fresh pair (a no-op; it opens the connection) "
                f"{median(firsts):,.2f} ms, median of {len(firsts)}"
            )
    if any(row.met is not None and not row.judged for row in rows):
        lines.append(
            f"marks in parentheses are indicative: a target is judged over at least "
            f"{JUDGED_FROM_ROUNDS} rounds ({SPREAD_JUDGED_FROM_PAIRS} pairs for the spread)"
        )
    for index, result in enumerate(raw.get("asyncrpc", {}).get("calls", [])):
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


def plot(path: Path, plotted: Results, title: str) -> None:
    """Two panels: the bandwidth curve (GB/s against size) and the N-client scaling."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    for side, points in plotted["bandwidth"].items():
        sizes = [p["bytes"] for p in points]
        left.plot(sizes, [p["gb_per_s"] for p in points], marker="o", label=LABELS[side])
        left.set_xticks(sizes, [size_label(s) for s in sizes])
    left.set(xlabel="tensor size", ylabel="GB/s (both ways)", title="tensor echo bandwidth")
    for side, points in plotted["fanin"].items():
        counts = [p["clients"] for p in points]
        right.plot(counts, [p["calls_per_s"] for p in points], marker="o", label=LABELS[side])
        right.set_xticks(counts)
    right.set_ylim(bottom=0)
    right.set(xlabel="clients (64 calls in flight each)", ylabel="server calls/s")
    right.set_title("1 server + N clients, no-op calls")
    for axes in (left, right):
        axes.grid(True, which="both", alpha=0.3)
        if axes.lines:
            axes.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    """CPUs of the callers and the server: ``same`` shares one, ``split`` gives each its own."""
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


def veth_skipped(workloads: list[str]) -> str | None:
    """Why the ``veth`` workload cannot run here (a namespace pair is made and deleted
    to find out), or None if it can or was not asked for."""
    if "veth" not in workloads:
        return None
    try:
        with veth_pair():
            return None
    except VethUnavailableError as exc:
        return f"veth rows skipped: cannot make two namespaces joined by a veth pair here ({exc})"


def workload_list(text: str) -> list[str]:
    chosen = {name.strip() for name in text.split(",") if name.strip()}
    if unknown := chosen - set(WORKLOADS):
        raise argparse.ArgumentTypeError(f"unknown workload(s): {', '.join(sorted(unknown))}")
    return [name for name in WORKLOADS if name in chosen]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one round, small counts, tensors up to 4 MB, up to 2 clients (smoke test)",
    )
    parser.add_argument("--only", choices=SIDES, help="run one framework only (for profiling)")
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="fresh processes per job and framework, alternating (default 5; quick 1)",
    )
    parser.add_argument(
        "--workloads",
        type=workload_list,
        default=list(WORKLOADS),
        metavar="LIST",
        help=f"comma-separated, of {','.join(WORKLOADS)} (default: all; veth needs root "
        "and iproute2, else it is skipped with a note)",
    )
    parser.add_argument(
        "--skip-1g", action="store_true", help="end the bandwidth curve at 256 MB (less memory)"
    )
    parser.add_argument(
        "--pin",
        choices=("same", "split"),
        help="callers and server on one CPU, or on one each (default: where the OS puts them)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help=f"where to write every number (default {RESULTS.name}/latest.json; quick: quick.json)",
    )
    parser.add_argument(
        "--plot", type=Path, metavar="PATH", help="the PNG (default: the JSON path, .png)"
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.workloads:
        parser.error("--workloads names none")
    args.json = args.json or RESULTS / ("quick.json" if args.quick else "latest.json")
    args.plot = args.plot or args.json.with_suffix(".png")
    return args


def exit_on_sigterm(signum: int, frame: object) -> None:
    """Turn SIGTERM into SystemExit, so that ``run_job`` still kills its workers."""
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
    if skipped := veth_skipped(args.workloads):  # said under the tables
        args.workloads = [w for w in args.workloads if w != "veth"]
        if not args.workloads:
            raise BenchError(skipped)
    cpus = pinning(args.pin)
    largest = max(n for n in cfg.bandwidth_sizes if not (args.skip_1g and n >= GB))
    plan = schedule(cfg, args.workloads, args.rounds, largest)
    raw, failure = run_rounds(sides, plan, args.quick, cpus)
    rows, floor = build_rows(cfg, raw), floor_rows(cfg, raw)
    load_after = load_average()
    summary_line = (
        f"mode: {mode}, {args.rounds} round(s) per framework (median over rounds), "
        f"workloads: {','.join(args.workloads)}, CPUs of callers/server: {describe(cpus)}, "
        f"1-min load average {load_before:.2f} before / {load_after:.2f} after"
    )
    print(f"\n{summary_line}\n")
    print(render(rows))
    print(f"\nPer round:\n\n{render_rounds(rows)}")
    if floor:
        print(f"\n{FLOOR_TITLE}\n\n{render(floor, 'floor')}\n\n{render_rounds(floor, 'floor')}")
    print("\n".join(["", *notes(raw, rows), *([skipped] if skipped else [])]))
    plotted = curves(cfg, raw)
    payload = {
        "machine": info,
        "mode": mode,
        "rounds": args.rounds,
        "workloads": args.workloads,
        "cpus": list(cpus),
        "config": cfg.as_dict(),
        "load_average": [load_before, load_after],
        "failure": failure,
        "skipped": skipped,
        "rows": [asdict(row) for row in rows],
        "floor_rows": [asdict(row) for row in floor],
        "combined": combine_calls(raw),
        "curves": plotted,
        "raw": raw,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2, ensure_ascii=False))
    print(f"\nwrote {args.json}")
    if plotted["bandwidth"] or plotted["fanin"]:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        title = (
            f"{mode} run, {args.rounds} round(s), {time.strftime('%Y-%m-%d')}; {info['cpu_model']}"
        )
        plot(args.plot, plotted, title)
        print(f"wrote {args.plot}")
    if failure:
        print(f"benchmark failed: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
