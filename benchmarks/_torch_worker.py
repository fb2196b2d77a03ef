"""One torch.distributed.rpc (TensorPipe) worker of the benchmark; see bench_rpc.py.

Rank 0 drives every workload against rank 1 and writes its numbers as JSON;
rank 1 only serves.  Both leave through the graceful ``rpc.shutdown``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import _remote_fns as fns
import torch
import torch.distributed.autograd as dist_autograd
from _common import (
    CALLEE,
    MB,
    Config,
    Results,
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
from torch.distributed import rpc
from torch.distributed.optim import DistributedOptimizer
from torch.nn.functional import cross_entropy


def sequential_us(
    cfg: Config, once: Callable[[], Any], counts: tuple[int, int, int] | None = None
) -> Results:
    """Mean time of ``once()`` run back to back, per batch, after a warm-up.

    ``counts`` is (warm-up, batches, calls per batch); by default ``cfg.call_counts``.
    """
    warmup, batches, per_batch = counts or cfg.call_counts
    for _ in range(warmup):
        once()
    per_call = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(per_batch):
            once()
        per_call.append(ns_to_us(time.perf_counter_ns() - start, per_batch))
    return summary(per_call)


def latency_us(cfg: Config, func: Any) -> Results:
    """Mean per-call time of sequential ``rpc_sync`` calls of ``func``."""
    return sequential_us(cfg, lambda: rpc.rpc_sync(CALLEE, func))


def remote_to_here() -> int:
    """``rpc.remote`` then ``to_here()``; the RRef dies on return, so a delete follows."""
    rref = rpc.remote(CALLEE, fns.add, args=(1, 2))
    value: int = rref.to_here()
    return value


def remote_to_here_us(cfg: Config) -> Results:
    check_value(3, remote_to_here())
    return sequential_us(cfg, remote_to_here)


def rref_method_us(cfg: Config) -> Results:
    """Sequential ``rref.rpc_async().get().wait()`` on one RRef of a ``Box`` made up front."""
    rref = rpc.remote(CALLEE, fns.Box)
    check_value(7, rref.rpc_async().get().wait())
    return sequential_us(cfg, lambda: rref.rpc_async().get().wait())


def model_parallel_step_us(cfg: Config) -> Results:
    """Training steps of an MLP split in two: stage 1 here, stage 2 on the callee."""
    stage1 = make_stage1()
    stage2 = rpc.remote(CALLEE, fns.Stage2)
    params = [rpc.RRef(p) for p in stage1.parameters()]
    params += stage2.rpc_sync().parameter_rrefs("torch")
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x, y = make_batch()

    def step() -> torch.Tensor:
        with dist_autograd.context() as ctx:
            h = stage1(x)
            out = stage2.rpc_sync().forward(h)
            loss = cross_entropy(out, y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        return loss.detach()

    first = step()
    result = sequential_us(cfg, step, cfg.step_counts)
    check_trained(first, step())
    return result


def run_window(cfg: Config, calls: int) -> float:
    """Issue ``calls`` no-op calls with ``cfg.window`` in flight; returns calls per second."""
    slots = threading.Semaphore(cfg.window)
    errors: list[BaseException] = []

    def done(future: torch.futures.Future[None]) -> None:
        try:
            future.wait()
        except BaseException as exc:
            errors.append(exc)
        slots.release()

    def take_slot() -> None:
        if not slots.acquire(timeout=cfg.rpc_timeout):
            raise TimeoutError(f"no reply within {cfg.rpc_timeout}s with a full window")

    start = time.perf_counter_ns()
    for _ in range(calls):
        take_slot()
        rpc.rpc_async(CALLEE, fns.noop).add_done_callback(done)
    for _ in range(cfg.window):
        take_slot()
    elapsed = time.perf_counter_ns() - start
    if errors:
        raise errors[0]
    return calls / (elapsed / 1e9)


def pipelined_rate(cfg: Config) -> Results:
    run_window(cfg, cfg.pipelined_warmup)
    return summary([run_window(cfg, cfg.pipelined_calls) for _ in range(cfg.pipelined_repeats)])


def memory_probe(cfg: Config) -> Results:
    """Growth of the callee's peak RSS while it receives, then echoes, the largest tensor."""
    size_mb = max(cfg.sizes_mb)
    tensor = make_tensor(size_mb * MB)
    base = rpc.rpc_sync(CALLEE, fns.peak_rss_kb)
    received = rpc.rpc_sync(CALLEE, fns.peak_rss_kb_after_receiving, args=(tensor,))
    check_echo(tensor, rpc.rpc_sync(CALLEE, fns.echo, args=(tensor,)))
    echoed = rpc.rpc_sync(CALLEE, fns.peak_rss_kb)
    return {
        "size_mb": size_mb,
        "receive_growth_mb": (received - base) / 1024,
        "echo_growth_mb": (echoed - base) / 1024,
    }


def echo_ms(size_mb: int, repeats: int) -> Results:
    """Round-trip times (ms) of echoing a ``size_mb`` tensor, after a checked warm-up."""
    tensor = make_tensor(size_mb * MB)
    check_echo(tensor, rpc.rpc_sync(CALLEE, fns.echo, args=(tensor,)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        result = rpc.rpc_sync(CALLEE, fns.echo, args=(tensor,))
        times.append((time.perf_counter_ns() - start) / 1e6)
        del result
    return summary(times)


def drive(cfg: Config) -> Results:
    results: Results = {
        "noop_us": latency_us(cfg, fns.noop),
        "async_execution_noop_us": latency_us(cfg, fns.completed_future),
        "remote_to_here_us": remote_to_here_us(cfg),
        "rref_method_us": rref_method_us(cfg),
        "model_parallel_step_us": model_parallel_step_us(cfg),
        "pipelined_calls_per_s": pipelined_rate(cfg),
        "memory": memory_probe(cfg),
        "echo_ms": {},
    }
    for mb, repeats in zip(cfg.sizes_mb, cfg.echo_repeats, strict=True):
        results["echo_ms"][str(mb)] = echo_ms(mb, repeats)
    return results


def main() -> None:
    # torch's own rpc.init_rpc/shutdown trigger this deprecation warning; it is not ours.
    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
    # torch's DistributedOptimizer wraps SGD in a TorchScript functional optimizer.
    warnings.filterwarnings("ignore", message="`TorchScript` support for functional optimizers")
    args = parse_worker_args()
    pin_to(args.cpu)
    cfg = config(args.quick)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=args.init_method, num_worker_threads=16, rpc_timeout=cfg.rpc_timeout
    )
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        f"w{args.rank}", rank=args.rank, world_size=2, rpc_backend_options=options
    )
    try:
        if args.rank == 0:
            write_results(args.out, drive(cfg))
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
