"""One asyncrpc worker of the benchmark (on uvloop); see bench_rpc.py.

The last rank (``server``) only serves; every other rank runs ``--workload`` against
it and writes its numbers as JSON.  All leave through the graceful ``asyncrpc.shutdown``.
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
    Echoes,
    Results,
    WorkerArgs,
    check_echo,
    check_value,
    config,
    make_batch,
    make_stage1,
    make_state_dict,
    make_tensor,
    ns_to_us,
    parse_worker_args,
    percentiles,
    pin_to,
    sequential_us,
    size_label,
    summary,
    trained_step_us,
    write_results,
)
from torch.nn.functional import cross_entropy

import asyncrpc

T = TypeVar("T")
SERVE_LIMIT_S = 600.0
"""How long the serving rank waits for the driver to finish (the parent kills sooner)."""


async def call(func: Any, *args: Any) -> Any:
    return await asyncrpc.rpc_async(CALLEE, func, args=args)


async def latency_us(cfg: Config, func: Any) -> Results:
    """Mean per-call time of sequential awaited calls of ``func``."""
    return await sequential_us(cfg, lambda: call(func))


async def state_dict_push_us(cfg: Config) -> Results:
    """A model's state dict (``make_state_dict``) sent, its tensor count answered."""
    state = make_state_dict()
    check_value(len(state), await call(fns.tensor_count, state))
    return await sequential_us(cfg, lambda: call(fns.tensor_count, state), cfg.step_counts)


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

    return await trained_step_us(cfg, step)


async def run_window(window: int, calls: int) -> tuple[int, int]:
    """Issue ``calls`` no-op calls with ``window`` in flight; returns (start, end) in
    ``time.monotonic_ns()``, a clock all processes of the host share."""
    slots = asyncio.Semaphore(window)
    errors: list[BaseException] = []

    def done(future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            errors.append(asyncio.CancelledError())
        elif future.exception() is not None:
            errors.append(future.exception())  # type: ignore[arg-type]
        slots.release()

    start = time.monotonic_ns()
    for _ in range(calls):
        await slots.acquire()
        asyncrpc.rpc_async(CALLEE, fns.noop).add_done_callback(done)
    for _ in range(window):
        await slots.acquire()
    end = time.monotonic_ns()
    if errors:
        raise errors[0]
    return start, end


def rate(calls: int, span: tuple[int, int]) -> float:
    return calls / ((span[1] - span[0]) / 1e9)


async def pipelined_rate(cfg: Config) -> Results:
    await run_window(cfg.window, cfg.pipelined_warmup)
    calls = cfg.pipelined_calls
    rates = [rate(calls, await run_window(cfg.window, calls)) for _ in range(cfg.pipelined_repeats)]
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


async def echo_ms(cfg: Config, nbytes: int, repeats: int, *, keep_previous: bool) -> Results:
    """Round-trip times (ms) of echoing a tensor of ``nbytes`` (see ``Echoes``)."""
    echoes = Echoes(cfg, nbytes, repeats, keep_previous=keep_previous)
    for index in echoes.rounds:
        start = time.perf_counter_ns()
        result = await call(fns.echo, echoes.tensor)
        echoes.record(index, result, time.perf_counter_ns() - start)
        del result  # without keep_previous, not alive during the next echo
    return echoes.results()


async def echo_rows(cfg: Config, *, keep_previous: bool) -> Results:
    """``echo_ms`` of each of ``cfg.sizes_mb``, keyed by size in MB."""
    return {
        str(nbytes // MB): await bounded(
            cfg, echo_ms(cfg, nbytes, repeats, keep_previous=keep_previous)
        )
        for nbytes, repeats in cfg.echo_sizes
    }


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


async def calls(cfg: Config, job: WorkerArgs) -> Results:
    """The small-call rows, the memory probe and the plain tensor echo."""
    return {
        "noop_us": await bounded(cfg, latency_us(cfg, fns.noop)),
        "coroutine_noop_us": await bounded(cfg, latency_us(cfg, fns.coro_noop)),
        "remote_to_here_us": await bounded(cfg, remote_to_here_us(cfg)),
        "rref_method_us": await bounded(cfg, rref_method_us(cfg)),
        "model_parallel_step_us": await bounded(cfg, model_parallel_step_us(cfg)),
        "state_dict_push_us": await bounded(cfg, state_dict_push_us(cfg)),
        "pipelined_calls_per_s": await bounded(cfg, pipelined_rate(cfg)),
        "noop_after_burst_us": await bounded(cfg, latency_us(cfg, fns.noop)),
        "memory": await bounded(cfg, memory_probe(cfg)),
        "echo_ms": await echo_rows(cfg, keep_previous=False),
        "debug_info": await bounded(cfg, debug_info_when_settled()),
    }


async def cold(cfg: Config, job: WorkerArgs) -> Results:
    """In a fresh pair: one no-op (it opens the connection), then the first echo of all."""
    assert job.size is not None
    tensor = make_tensor(job.size)
    start = time.perf_counter_ns()
    await bounded(cfg, call(fns.noop))
    noop_done = time.perf_counter_ns()
    result = await bounded(cfg, call(fns.echo, tensor))
    echo_done = time.perf_counter_ns()
    check_echo(tensor, result)
    return {
        "first_noop_ms": (noop_done - start) / 1e6,
        "first_echo_ms": (echo_done - noop_done) / 1e6,
    }


async def steady(cfg: Config, job: WorkerArgs) -> Results:
    return {"echo_ms": await echo_rows(cfg, keep_previous=True)}


async def tcp(cfg: Config, job: WorkerArgs) -> Results:
    """Over TCP only (see ``main``): the first echo of ``job.size`` bytes of a fresh
    pair, then steady echoes of it with the previous result alive."""
    assert job.size is not None
    first = await cold(cfg, job)
    repeats = dict(cfg.echo_sizes).get(job.size, cfg.bandwidth_repeats(job.size))
    steady = echo_ms(cfg, job.size, repeats, keep_previous=True)
    return {**first, "echo_ms": await bounded(cfg, steady)}


async def bandwidth(cfg: Config, job: WorkerArgs) -> Results:
    """Echo times along ``cfg.bandwidth_sizes``, up to ``job.size`` bytes."""
    assert job.size is not None
    return {
        size_label(nbytes): await bounded(
            cfg, echo_ms(cfg, nbytes, cfg.bandwidth_repeats(nbytes), keep_previous=False)
        )
        for nbytes in cfg.bandwidth_sizes
        if nbytes <= job.size
    }


async def fanin(cfg: Config, job: WorkerArgs) -> Results:
    """One of ``job.clients`` clients, each with ``cfg.fanin_window`` no-ops in flight;
    every timed window starts when all clients are ready."""
    await bounded(cfg, run_window(cfg.fanin_window, cfg.fanin_warmup))
    spans = []
    for _ in range(cfg.fanin_repeats):
        await bounded(cfg, call(fns.rendezvous, job.clients))
        spans.append(await bounded(cfg, run_window(cfg.fanin_window, cfg.fanin_calls)))
    return {"calls": cfg.fanin_calls, "spans_ns": spans}


async def spread(cfg: Config, job: WorkerArgs) -> Results:
    """Percentiles of single sequential no-op round trips (µs), after a warm-up."""
    for _ in range(cfg.spread_warmup):
        await call(fns.noop)
    samples = []
    for _ in range(cfg.spread_calls):
        start = time.perf_counter_ns()
        await call(fns.noop)
        samples.append(ns_to_us(time.perf_counter_ns() - start, 1))
    return {"noop_us": percentiles(samples)}


WORKLOADS: dict[str, Callable[[Config, WorkerArgs], Awaitable[Results]]] = {
    "calls": calls,
    "cold": cold,
    "steady": steady,
    "bandwidth": bandwidth,
    "fanin": fanin,
    "spread": spread,
    "tcp": tcp,
    "veth": tcp,  # the same, the two processes in two namespaces joined by a veth pair
}
TCP_ONLY: dict[str, Any] = {"transports": ("tcp",), "shared_memory": False}
"""asyncrpc over TCP alone (no unix socket, no shared memory): ``--workload tcp``/``veth``
(across namespaces it listens on the address that routes to ``--host``, its veth end)."""


async def main(args: WorkerArgs) -> None:
    cfg = config(args.quick)
    await asyncrpc.init_rpc(
        args.name,
        rank=args.rank,
        world_size=args.world_size,
        init_method=args.init_method,
        rpc_timeout=cfg.rpc_timeout,
        **(TCP_ONLY if args.tcp_only else {}),
    )
    try:
        if not args.serves:
            write_results(args.results_path, await WORKLOADS[args.workload](cfg, args))
    finally:
        await asyncrpc.shutdown(timeout=SERVE_LIMIT_S if args.serves else cfg.rpc_timeout)


if __name__ == "__main__":
    worker_args = parse_worker_args()
    pin_to(worker_args.cpu)
    uvloop.run(main(worker_args))
