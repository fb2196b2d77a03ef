"""One asyncrpc worker of the benchmark (on uvloop); see bench_rpc.py.

Rank 0 drives every workload against rank 1 and writes its numbers as JSON;
rank 1 only serves.  Both leave through the graceful ``asyncrpc.shutdown``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import _remote_fns as fns
import torch
import uvloop
from _common import (
    CALLEE,
    MB,
    Config,
    Results,
    WorkerArgs,
    check_echo,
    check_trained,
    check_value,
    config,
    make_batch,
    make_stage1,
    make_tensor,
    ns_to_us,
    parse_worker_args,
    pin_to,
    summary,
    write_results,
)
from torch.nn.functional import cross_entropy

import asyncrpc

T = TypeVar("T")
SERVE_LIMIT_S = 600.0
"""How long the serving rank waits for the driver to finish (the parent kills sooner)."""


async def call(func: Any, *args: Any) -> Any:
    return await asyncrpc.rpc_async(CALLEE, func, args=args)


async def sequential_us(
    cfg: Config,
    once: Callable[[], Awaitable[Any]],
    counts: tuple[int, int, int] | None = None,
) -> Results:
    """Mean time of ``await once()`` run back to back, per batch, after a warm-up.

    ``counts`` is (warm-up, batches, calls per batch); by default ``cfg.call_counts``.
    """
    warmup, batches, per_batch = counts or cfg.call_counts
    for _ in range(warmup):
        await once()
    per_call = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(per_batch):
            await once()
        per_call.append(ns_to_us(time.perf_counter_ns() - start, per_batch))
    return summary(per_call)


async def latency_us(cfg: Config, func: Any) -> Results:
    """Mean per-call time of sequential awaited calls of ``func``."""
    return await sequential_us(cfg, lambda: call(func))


async def remote_to_here() -> int:
    """``remote()`` then ``to_here()``; the RRef dies on return, so a delete follows."""
    rref = asyncrpc.remote(CALLEE, fns.add, args=(1, 2))
    value: int = await rref.to_here()
    return value


async def remote_to_here_us(cfg: Config) -> Results:
    check_value(3, await remote_to_here())
    return await sequential_us(cfg, remote_to_here)


async def rref_method_us(cfg: Config) -> Results:
    """Sequential ``rref.rpc_async().get()`` on one RRef of a ``Box`` made up front."""
    rref = asyncrpc.remote(CALLEE, fns.Box)
    check_value(7, await rref.rpc_async().get())
    return await sequential_us(cfg, lambda: rref.rpc_async().get())


async def model_parallel_step_us(cfg: Config) -> Results:
    """Training steps of an MLP split in two: stage 1 here, stage 2 on the callee."""
    stage1 = make_stage1()
    stage2 = asyncrpc.remote(CALLEE, fns.Stage2)
    params = [asyncrpc.RRef(p) for p in stage1.parameters()]
    params += await stage2.rpc_async().parameter_rrefs("asyncrpc")
    opt = asyncrpc.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x, y = make_batch()

    async def step() -> torch.Tensor:
        async with asyncrpc.autograd.context() as ctx:
            h = stage1(x)
            out = await stage2.rpc_async().forward(h)
            loss = cross_entropy(out, y)
            await asyncrpc.autograd.backward(ctx, [loss])
            await opt.step(ctx)
        return loss.detach()

    first = await step()
    result = await sequential_us(cfg, step, cfg.step_counts)
    check_trained(first, await step())
    return result


async def run_window(cfg: Config, calls: int) -> float:
    """Issue ``calls`` no-op calls with ``cfg.window`` in flight; returns calls per second."""
    slots = asyncio.Semaphore(cfg.window)
    errors: list[BaseException] = []

    def done(future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            errors.append(asyncio.CancelledError())
        elif future.exception() is not None:
            errors.append(future.exception())  # type: ignore[arg-type]
        slots.release()

    start = time.perf_counter_ns()
    for _ in range(calls):
        await slots.acquire()
        asyncrpc.rpc_async(CALLEE, fns.noop).add_done_callback(done)
    for _ in range(cfg.window):
        await slots.acquire()
    elapsed = time.perf_counter_ns() - start
    if errors:
        raise errors[0]
    return calls / (elapsed / 1e9)


async def pipelined_rate(cfg: Config) -> Results:
    await run_window(cfg, cfg.pipelined_warmup)
    rates = [await run_window(cfg, cfg.pipelined_calls) for _ in range(cfg.pipelined_repeats)]
    return summary(rates)


async def memory_probe(cfg: Config) -> Results:
    """Growth of the callee's peak RSS while it receives, then echoes, the largest tensor."""
    size_mb = max(cfg.sizes_mb)
    tensor = make_tensor(size_mb * MB)
    base = await call(fns.peak_rss_kb)
    received = await call(fns.peak_rss_kb_after_receiving, tensor)
    check_echo(tensor, await call(fns.echo, tensor))
    echoed = await call(fns.peak_rss_kb)
    return {
        "size_mb": size_mb,
        "receive_growth_mb": (received - base) / 1024,
        "echo_growth_mb": (echoed - base) / 1024,
    }


async def echo_ms(size_mb: int, repeats: int) -> Results:
    """Round-trip times (ms) of echoing a ``size_mb`` tensor, after a checked warm-up."""
    tensor = make_tensor(size_mb * MB)
    check_echo(tensor, await call(fns.echo, tensor))
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        result = await call(fns.echo, tensor)
        times.append((time.perf_counter_ns() - start) / 1e6)
        del result
    return summary(times)


async def debug_info_when_settled() -> dict[str, Any]:
    """This worker's debug info after a few round trips, so that segment releases land."""
    for _ in range(100):
        await call(fns.noop)
    info: dict[str, Any] = asyncrpc.get_debug_info()
    return info


async def bounded(cfg: Config, step: Coroutine[Any, Any, T]) -> T:
    """Await one workload, failing it after ``cfg.step_timeout`` seconds."""
    async with asyncio.timeout(cfg.step_timeout):
        return await step


async def drive(cfg: Config) -> Results:
    results: Results = {
        "noop_us": await bounded(cfg, latency_us(cfg, fns.noop)),
        "coroutine_noop_us": await bounded(cfg, latency_us(cfg, fns.coro_noop)),
        "remote_to_here_us": await bounded(cfg, remote_to_here_us(cfg)),
        "rref_method_us": await bounded(cfg, rref_method_us(cfg)),
        "model_parallel_step_us": await bounded(cfg, model_parallel_step_us(cfg)),
        "pipelined_calls_per_s": await bounded(cfg, pipelined_rate(cfg)),
        "memory": await bounded(cfg, memory_probe(cfg)),
        "echo_ms": {},
    }
    for mb, repeats in zip(cfg.sizes_mb, cfg.echo_repeats, strict=True):
        results["echo_ms"][str(mb)] = await bounded(cfg, echo_ms(mb, repeats))
    results["debug_info"] = await bounded(cfg, debug_info_when_settled())
    return results


async def main(args: WorkerArgs) -> None:
    cfg = config(args.quick)
    await asyncrpc.init_rpc(
        f"w{args.rank}",
        rank=args.rank,
        world_size=2,
        init_method=args.init_method,
        rpc_timeout=cfg.rpc_timeout,
    )
    try:
        if args.rank == 0:
            write_results(args.out, await drive(cfg))
    finally:
        await asyncrpc.shutdown(timeout=cfg.rpc_timeout if args.rank == 0 else SERVE_LIMIT_S)


if __name__ == "__main__":
    worker_args = parse_worker_args()
    pin_to(worker_args.cpu)
    uvloop.run(main(worker_args))
