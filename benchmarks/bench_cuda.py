"""CUDA benchmark: asyncrpc against torch.distributed.rpc (TensorPipe) on one GPU.

What it measures
----------------
Every job is a fresh pair of processes on this host, both on ``cuda:0``: ``w0`` calls,
``w1`` serves.  Only the caller maps devices (asyncrpc ``device_maps={"w1": {"cuda:0":
"cuda:0"}}``, torch ``TensorPipeRpcBackendOptions(device_maps={"w1": {0: 0}})``, torch
with ``devices=[0]`` on both); replies come back by the inverse map.  Workers are fresh
interpreters (subprocess: nothing forks after CUDA is initialised) that start CUDA and
cuBLAS before ``init_rpc``, so no timing includes creating a CUDA context.  A round runs
one pair of each kind: torch, asyncrpc (CUDA IPC), asyncrpc with ``shared_memory=False``
(host staging), the order reversed every other round; 5 rounds (``--rounds``), fewer if
the next would end past ``--time-budget`` (140 s; a pair is killed after 90 s, or 15 s
after its caller finished).  In a pair the caller makes one no-op call (it opens the
connection), then:

1. CUDA tensor echo: ``echo(x)`` sends back its float32 argument of 4, 64 and 400 MB
   (2**20 bytes) on cuda:0.  A call is timed until its result is usable: the call
   (asyncrpc ``await rpc_async``, torch ``rpc_sync``), then
   ``torch.cuda.current_stream().synchronize()``.  cold: the first echo of that size
   in the pair (checked equal to what was sent); steady: the median of 10 echoes after
   one more, each result kept alive until the next has arrived (``prev = await ...``).
   Every result must be on cuda:0.
2. asyncrpc's two paths: the echoes of 1 over CUDA IPC (the asyncrpc pairs) and through
   pinned host memory (the ``shared_memory=False`` pairs, which run only the echo).
   Under the table: the path to w1 and the tensors each worker sent by each path, from
   ``get_debug_info()["cuda"]``.
3. model-parallel training step: stage 1 (Linear(1024, 1024) + ReLU) on the caller's
   GPU, stage 2 (Linear(1024, 4096) + ReLU + Linear(4096, 1024)) made on w1's cuda:0
   with ``remote()``, a fixed 64 x 1024 batch and MSE target.  A step opens a
   distributed autograd context, runs stage 1, ``stage2.rpc_async().forward`` (torch
   ``rpc_sync()``), the loss, the distributed backward and a ``DistributedOptimizer``
   (SGD, lr 0.01) step over both stages' parameter RRefs; timed as in 1.  cold: the
   first step of the pair; steady: the median of 20 after two more.  If torch raises
   (CUDA tensors in distributed autograd or its optimizer), the notes say ``torch:
   refused (<its error>)``, later torch pairs skip the step, and asyncrpc's figures
   stand alone.

How to read it
--------------
Each row: the median over rounds of each side (ms), the ratio of the medians, then
every round's values and ratio.  ratio = torch time / asyncrpc time (above 1: asyncrpc
is faster); in table 2, staging time / IPC time.  Cold figures are one sample per
round: noisy.  Everything, every round, goes to ``benchmarks/results/cuda.json``
(``--json``).  A failed pair is noted and the run goes on; the exit status is 1 if
anything of asyncrpc's failed (a torch failure or refusal is a finding: 0).  Without
CUDA it prints "no CUDA device: skipped" and exits 0.

Usage: ``python benchmarks/bench_cuda.py [--rounds N] [--sizes 4,64,400] [--no-step]
[--time-budget S] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _remote_fns as fns  # noqa: E402
import bench_rpc as base  # noqa: E402
import torch  # noqa: E402
from _common import MB, Echoes, Results, config, median, size_label, summary  # noqa: E402
from _common import write_results as _write  # noqa: E402

KINDS = ("torch", "asyncrpc", "asyncrpc-staged")
NAMES, CALLEE, DEVICE = ("w0", "w1"), "w1", "cuda:0"
STEADY_CALLS = 10  # after Echoes' 2 untimed echoes (the cold one first)
STEP_WARMUP, STEP_CALLS, LR = 2, 20, 0.01
WIDTH, HIDDEN, ROWS = 1024, 4096, 64
RPC_TIMEOUT_S, PAIR_LIMIT_S, SHUTDOWN_GRACE_S = 60.0, 90.0, 15.0
RESULTS = HERE / "results" / "cuda.json"
Call = Callable[..., Awaitable[Any]]
"""``call(func, *args)``: ``func(*args)`` run on w1, awaited (each framework's own)."""
mse_loss = torch.nn.functional.mse_loss


# -- what the callers of both frameworks run ----------------------------------------------


def cuda_stage1() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()).to(DEVICE)


def cuda_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x, target = (torch.randn(ROWS, WIDTH, generator=generator) for _ in range(2))
    return x.to(DEVICE), target.to(DEVICE)


class CudaStage2(fns.Stage2):
    """Stage 2 on w1's cuda:0; ``forward`` and ``parameter_rrefs`` are bench_rpc's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH)
        ).to(DEVICE)


async def cuda_stats() -> dict[str, Any]:
    """This worker's ``get_debug_info()["cuda"]`` (asyncrpc; a coroutine, so it runs on
    the callee's event loop), as plain JSON values."""
    import asyncrpc

    return dict(json.loads(json.dumps(asyncrpc.get_debug_info()["cuda"], default=str)))


async def timed(once: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    """ns until ``await once()`` returned and the current stream ran what it queued."""
    start = time.perf_counter_ns()
    value = await once()
    torch.cuda.current_stream().synchronize()
    return time.perf_counter_ns() - start, value


async def echo_size(call: Call, nbytes: int) -> Results:
    echoes = Echoes(config(False), nbytes, STEADY_CALLS, keep_previous=True)
    echoes.tensor = x = echoes.tensor.to(DEVICE)  # (Echoes makes it on the CPU)
    torch.cuda.synchronize()
    cold_ms = 0.0
    for index in echoes.rounds:
        elapsed, result = await timed(partial(call, fns.echo, x))
        if not isinstance(result, torch.Tensor) or result.device != x.device:
            raise AssertionError(f"echo came back as {result!r:.80}, not on {DEVICE}")
        echoes.record(index, result, elapsed)  # checks echo 0; keeps the result alive
        cold_ms = cold_ms if index else elapsed / 1e6
        del result
    return {"cold_ms": cold_ms, "steady_ms": echoes.results()}


async def step_phase(make_step: Callable[[], Awaitable[Any]]) -> Results:
    step = await make_step()
    cold, first = await timed(step)
    for _ in range(STEP_WARMUP):
        await step()
    times, last = [], first
    for _ in range(STEP_CALLS):
        elapsed, last = await timed(step)  # the previous loss stays alive meanwhile
        times.append(elapsed / 1e6)
    losses = [float(first), float(last)]
    return {"cold_ms": cold / 1e6, "steady_ms": summary(times), "losses": losses}


def first_line(exc: BaseException) -> str:
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    useful = [s for s in lines if not s.startswith("On WorkerInfo")] or [""]
    return f"{type(exc).__name__}: {useful[0]}"[:300]


async def guarded(phase: Callable[[], Awaitable[Results]]) -> Results:
    try:
        return await phase()
    except Exception as exc:
        return {"error": first_line(exc), "error_text": str(exc)[:4000]}


def save(out: Path, results: Results, *, done: bool = False) -> None:
    """Atomically, so that the parent can read it whenever the pair ends."""
    _write(out / "rank0.tmp", results)
    (out / "rank0.tmp").replace(out / "rank0.json")
    if done:
        (out / "done").touch()


async def drive(args: argparse.Namespace, out: Path, call: Call, make_step: Any) -> Results:
    """The caller's run: a no-op, each echo size, the step; saved after each part."""
    results: Results = {"first_noop_ms": (await timed(partial(call, fns.noop)))[0] / 1e6}
    results["echo"] = {}
    for nbytes in args.sizes:
        found = await guarded(partial(echo_size, call, nbytes))
        results["echo"][size_label(nbytes)] = found
        save(out, results)
        if "error" in found:
            break
    if args.step:
        results["step"] = await guarded(partial(step_phase, make_step))
        save(out, results)
    return results


# -- the workers --------------------------------------------------------------------------


async def asyncrpc_step() -> Callable[[], Awaitable[torch.Tensor]]:
    import asyncrpc
    from asyncrpc.optim import DistributedOptimizer

    stage1, (x, target) = cuda_stage1(), cuda_batch()
    stage2 = asyncrpc.remote(CALLEE, CudaStage2)
    params = [asyncrpc.RRef(p) for p in stage1.parameters()]
    params += await stage2.rpc_async().parameter_rrefs("asyncrpc")
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    await opt.created()  # (torch's constructor waits for its optimizers too)

    async def step() -> torch.Tensor:
        async with asyncrpc.autograd.context() as ctx:
            loss = mse_loss(await stage2.rpc_async().forward(stage1(x)), target)
            await asyncrpc.autograd.backward(ctx, [loss])
            await opt.step(ctx)
        return loss.detach()

    return step


async def asyncrpc_worker(args: argparse.Namespace, rank: int, port: int, out: Path) -> None:
    import asyncrpc

    await asyncrpc.init_rpc(
        NAMES[rank],
        rank=rank,
        world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=RPC_TIMEOUT_S,
        device_maps={CALLEE: {DEVICE: DEVICE}} if rank == 0 else None,
        shared_memory=args.worker[0] != "asyncrpc-staged",
    )
    try:
        if rank == 0:

            def call(func: Any, *func_args: Any) -> Awaitable[Any]:
                return asyncrpc.rpc_async(CALLEE, func, args=func_args)

            results = await drive(args, out, call, asyncrpc_step)
            results["cuda"] = {"caller": await cuda_stats(), "callee": await call(cuda_stats)}
            save(out, results, done=True)
    finally:
        await asyncrpc.shutdown(timeout=RPC_TIMEOUT_S if rank == 0 else PAIR_LIMIT_S)


async def torch_step() -> Callable[[], Awaitable[torch.Tensor]]:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc
    from torch.distributed.optim import DistributedOptimizer

    stage1, (x, target) = cuda_stage1(), cuda_batch()
    stage2 = rpc.remote(CALLEE, CudaStage2)
    params = [rpc.RRef(p) for p in stage1.parameters()]
    params += stage2.rpc_sync().parameter_rrefs("torch")
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR)

    async def step() -> torch.Tensor:
        with dist_autograd.context() as ctx:
            loss = mse_loss(stage2.rpc_sync().forward(stage1(x)), target)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        return loss.detach()

    return step


async def torch_worker(args: argparse.Namespace, rank: int, port: int, out: Path) -> None:
    """torch's calls block: they run in coroutines only to share ``drive`` with asyncrpc."""
    from torch.distributed import rpc

    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
    warnings.filterwarnings("ignore", message="`TorchScript` support for functional optimizers")
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        num_worker_threads=16,
        rpc_timeout=RPC_TIMEOUT_S,
        devices=[0],
        device_maps={CALLEE: {0: 0}} if rank == 0 else None,
    )
    rpc.init_rpc(NAMES[rank], rank=rank, world_size=2, rpc_backend_options=options)  # type: ignore[no-untyped-call]
    try:
        if rank == 0:

            async def call(func: Any, *func_args: Any) -> Any:
                return rpc.rpc_sync(CALLEE, func, args=func_args)

            save(out, await drive(args, out, call, torch_step), done=True)
    finally:
        rpc.shutdown()


def run_worker(args: argparse.Namespace) -> int:
    kind, rank, port, out = args.worker
    torch.cuda.set_device(0)
    warm = torch.ones(256, 256, device=DEVICE)
    float((warm @ warm).sum())  # the CUDA context and cuBLAS are made before any timing
    work = (torch_worker if kind == "torch" else asyncrpc_worker)(
        args, int(rank), int(port), Path(out)
    )
    try:
        import uvloop  # asyncrpc runs on it, as in bench_rpc (torch does not use the loop)
    except ImportError:
        uvloop = asyncio  # type: ignore[assignment]
    uvloop.run(work)
    return 0


# -- the parent: pairs, rounds, tables ----------------------------------------------------


def run_pair(kind: str, out: Path, args: argparse.Namespace, step: bool) -> Results:
    """One fresh pair of ``kind``: what its caller saved, with ``error`` if it failed."""
    out.mkdir(parents=True)
    port, logs, procs = base.free_port(), [out / f"{name}.log" for name in NAMES], []
    path = [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**base.WORKER_ENV, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    flags = [f"--sizes={','.join(str(n // MB) for n in args.sizes)}"]
    flags += [] if step else ["--no-step"]
    worker = [sys.executable, str(HERE / "bench_cuda.py"), *flags, "--worker", kind]
    result: Results = {}
    started = time.monotonic()
    try:
        for rank, log in enumerate(logs):
            argv = [*worker, str(rank), str(port), str(out)]
            with log.open("wb") as sink:
                procs.append(Popen(argv, env=env, stdin=DEVNULL, stdout=sink, stderr=STDOUT))
        wait_pair(procs, logs, out / "done")
    except base.BenchError as exc:
        result["error"] = str(exc)
    finally:
        base.stop(procs)
    if (out / "rank0.json").exists():
        result = {**json.loads((out / "rank0.json").read_text()), **result}
    return {**result, "wall_s": time.monotonic() - started}


def wait_pair(procs: list[Popen[bytes]], logs: list[Path], done: Path) -> None:
    """Until both exit 0; BenchError at a failure, at the limit, or if the pair has not
    shut down ``SHUTDOWN_GRACE_S`` after its caller finished (its results are kept)."""
    deadline, finished = time.monotonic() + PAIR_LIMIT_S, None
    while True:
        codes = [proc.poll() for proc in procs]
        for code, log in zip(codes, logs, strict=True):
            if code not in (None, 0):
                raise base.BenchError(f"{log.stem} exited with {code}:\n{base.log_tail(log)}")
        if all(code == 0 for code in codes):
            return
        now = time.monotonic()
        finished = finished or (now if done.exists() else None)
        if finished is not None and now - finished > SHUTDOWN_GRACE_S:
            raise base.BenchError(f"finished but not shut down after {SHUTDOWN_GRACE_S:.0f}s")
        if now > deadline:
            raise base.BenchError(f"not done after {PAIR_LIMIT_S:.0f}s:\n{base.log_tail(logs[0])}")
        time.sleep(0.1)


def run_rounds(args: argparse.Namespace) -> tuple[dict[str, list[Results]], list[str]]:
    raw: dict[str, list[Results]] = {kind: [] for kind in KINDS}
    notes: list[str] = []
    no_step = {"asyncrpc-staged"} | (set() if args.step else set(KINDS))
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_cuda-") as tmp:
        for index in range(args.rounds):
            spent = time.monotonic() - begun
            if index and spent + spent / index > args.time_budget:
                notes.append(f"stopped after {index} rounds (--time-budget {args.time_budget:g})")
                break
            for kind in KINDS if index % 2 == 0 else KINDS[::-1]:
                result = run_pair(kind, Path(tmp) / f"{kind}-{index}", args, kind not in no_step)
                raw[kind].append(result)
                if "error" in result.get("step", {}):
                    no_step.add(kind)  # a refusal will not change in the next pair
                state = "failed" if "error" in result else "done"
                took = f"{result['wall_s']:.0f}s"
                print(f"round {index + 1}/{args.rounds}: {kind} {state} in {took}", flush=True)
    return raw, notes


TABLES = (  # key, title, the two kinds compared (ratio: first / second), their heads
    ("echo", "1. CUDA tensor echo, ms until usable", ("torch", "asyncrpc"), ("torch", "asyncrpc")),
    ("paths", "2. asyncrpc's two paths, ms", ("asyncrpc-staged", "asyncrpc"), ("staging", "IPC")),
    ("step", "3. model-parallel training step, ms", ("torch", "asyncrpc"), ("torch", "asyncrpc")),
)


def row_paths(key: str, sizes: tuple[int, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """(label, where in a caller's results) of each row of table ``key``."""
    steady = f"steady, median of {STEP_CALLS if key == 'step' else STEADY_CALLS}"
    if key == "step":
        return [("step cold", ("step", "cold_ms")), (f"step {steady}", ("step", "steady_ms"))]
    phases = (("cold_ms", "cold"), ("steady_ms", steady))
    return [
        (f"echo {n // MB} MB {p}", ("echo", size_label(n), at)) for n in sizes for at, p in phases
    ]


def value(result: Results, *path: str) -> float | None:
    found: Any = result
    for key in path:
        found = found.get(key) if isinstance(found, dict) else None
    found = found.get("median") if isinstance(found, dict) else found
    return float(found) if isinstance(found, int | float) else None


def row(name: str, a: list[float | None], b: list[float | None]) -> Results:
    """Medians over the rounds that have a value, their ratio a / b, and each round's."""
    mids = [median([v for v in vs if v is not None] or [math.nan]) for vs in (a, b)]
    a_mid, b_mid = (None if math.isnan(v) else v for v in mids)
    ratios = [base.speedup(x, y) for x, y in zip(a, b, strict=False)]
    return {
        "row": name,
        "a": a_mid,
        "b": b_mid,
        "ratio": base.speedup(a_mid, b_mid),
        "rounds": [a, b, ratios],
    }


def render(title: str, heads: tuple[str, str], rows: list[Results]) -> str:
    a, b = heads
    head = f"| | {a} | {b} | ratio | {a} per round | {b} per round | ratio per round |"
    lines = [f"\n{title}; ratio = {a} / {b}\n", head, "|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        per = [", ".join(base.compact(v) for v in values) or "—" for values in r["rounds"]]
        ratio = base.fmt(r["ratio"], lambda v: f"{v:.2f}{base.TIMES}")
        cells = [base.fmt(r["a"], base.ms), base.fmt(r["b"], base.ms), ratio, *per]
        lines.append(f"| {r['row']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def path_notes(raw: dict[str, list[Results]]) -> list[str]:
    """The path each asyncrpc kind took to w1, and the tensors sent by each (first pair)."""
    lines = []
    for kind, expected, other in (
        ("asyncrpc", "cuda ipc", "staged"),
        ("asyncrpc-staged", "host staging", "ipc"),
    ):
        info = next((r["cuda"] for r in raw[kind] if "cuda" in r), None)
        if info is None:
            lines.append(f"{kind}: no CUDA debug info")
            continue
        path = info["caller"].get("paths", {}).get(CALLEE, "?")
        sent = {
            w: {p: info[w].get(f"sent_{p}_tensors", 0) for p in ("ipc", "staged")} for w in info
        }
        lines.append(f"{kind}: path to {CALLEE} = {path!r}; tensors sent (first pair): {sent}")
        if path != expected or any(s[other] for s in sent.values()):
            lines.append(f"warning: {kind} should have used {expected!r} only")
    return lines


def problems(raw: dict[str, list[Results]]) -> tuple[list[str], int]:
    """Notes on failures, refusals and losses that did not fall; 1 if asyncrpc failed."""
    notes, rc = [], False
    for kind, results in raw.items():
        for index, r in enumerate(results):
            step, where = r.get("step", {}), f"in round {index + 1}"
            if "error" in step:
                what = "refused" if kind == "torch" else "failed"
                notes.append(f"{kind}: {what} ({step['error']}): the step, {where}")
            errors = [r.get("error"), *(e.get("error") for e in r.get("echo", {}).values())]
            notes += [f"{kind}: failed {where}: {error}" for error in errors if error]
            rc |= kind != "torch" and ("error" in step or any(errors))
            if (losses := step.get("losses")) and not losses[1] < losses[0]:
                notes.append(f"warning: {kind} {where}: the loss did not fall: {losses}")
        if firsts := [v for r in results if (v := value(r, "first_noop_ms")) is not None]:
            notes.append(f"{kind}: first call of a pair (a no-op) {median(firsts):,.1f} ms median")
    return notes, int(rc)


def report(args: argparse.Namespace, raw: dict[str, list[Results]], notes: list[str]) -> int:
    tables = {}
    for key, title, kinds, heads in TABLES[: 3 if args.step else 2]:
        cells = [
            (label, [[value(r, *at) for r in raw[k]] for k in kinds])
            for label, at in row_paths(key, args.sizes)
        ]
        tables[key] = [row(label, *values) for label, values in cells]
        print(render(title, heads, tables[key]))
        if key == "paths":
            print("\n".join(path_notes(raw)))
    found, rc = problems(raw)
    notes += found
    print("\n" + "\n".join(notes))
    try:
        host = base.machine()
    except Exception as exc:  # (it names packages: one missing must not lose the numbers)
        host = {"error": first_line(exc)}
    host |= {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    ran = max(map(len, raw.values()))
    settings = {"rounds": ran, "sizes_mb": [n // MB for n in args.sizes]}
    settings |= {"steady_calls": STEADY_CALLS, "step_calls": STEP_CALLS}
    payload = {"machine": host, "settings": settings, "tables": tables, "notes": notes, "raw": raw}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2, ensure_ascii=False, default=str))
    print(f"\nwrote {args.json}")
    return rc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="pairs of each kind (default 5)")
    parser.add_argument("--sizes", default="4,64,400", metavar="MB,...", help="echo sizes")
    parser.add_argument("--no-step", dest="step", action="store_false", help="skip workload 3")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=140.0,
        metavar="S",
        help="start no round that would end past S seconds from the start (default 140)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS, metavar="PATH")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # KIND RANK PORT OUT
    args = parser.parse_args(argv)
    args.sizes = tuple(int(mb) * MB for mb in args.sizes.split(",") if mb.strip())
    if args.rounds < 1 or not args.sizes:
        parser.error("--rounds must be at least 1 and --sizes name a size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    signal.signal(signal.SIGTERM, base.exit_on_sigterm)
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    raw, notes = run_rounds(args)
    return report(args, raw, notes)


if __name__ == "__main__":
    # Run as the module ``bench_cuda``, so that what goes by reference (CudaStage2,
    # cuda_stats) is named ``bench_cuda.*`` in both processes of a pair.
    import bench_cuda

    sys.exit(bench_cuda.main())
