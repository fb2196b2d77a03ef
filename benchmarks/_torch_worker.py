"""One torch.distributed.rpc (TensorPipe) worker of the benchmark; see bench_rpc.py.

The last rank (``server``) only serves; every other rank runs ``--workload`` against
it and writes its numbers as JSON.  All leave through the graceful ``rpc.shutdown``.
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
    Echoes,
    Results,
    WorkerArgs,
    check_echo,
    check_trained,
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
    size_label,
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


def state_dict_push_us(cfg: Config) -> Results:
    """A model's state dict (``make_state_dict``) sent, its tensor count answered."""
    state = make_state_dict()
    check_value(len(state), rpc.rpc_sync(CALLEE, fns.tensor_count, args=(state,)))
    return sequential_us(
        cfg, lambda: rpc.rpc_sync(CALLEE, fns.tensor_count, args=(state,)), cfg.step_counts
    )


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


def run_window(cfg: Config, window: int, calls: int) -> tuple[int, int]:
    """Issue ``calls`` no-op calls with ``window`` in flight; returns (start, end) in
    ``time.monotonic_ns()``, a clock all processes of the host share."""
    slots = threading.Semaphore(window)
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

    start = time.monotonic_ns()
    for _ in range(calls):
        take_slot()
        rpc.rpc_async(CALLEE, fns.noop).add_done_callback(done)
    for _ in range(window):
        take_slot()
    end = time.monotonic_ns()
    if errors:
        raise errors[0]
    return start, end


def rate(calls: int, span: tuple[int, int]) -> float:
    return calls / ((span[1] - span[0]) / 1e9)


def pipelined_rate(cfg: Config) -> Results:
    run_window(cfg, cfg.window, cfg.pipelined_warmup)
    calls = cfg.pipelined_calls
    return summary(
        [rate(calls, run_window(cfg, cfg.window, calls)) for _ in range(cfg.pipelined_repeats)]
    )


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


def echo_ms(cfg: Config, nbytes: int, repeats: int, *, keep_previous: bool) -> Results:
    """Round-trip times (ms) of echoing a tensor of ``nbytes`` (see ``Echoes``)."""
    echoes = Echoes(cfg, nbytes, repeats, keep_previous=keep_previous)
    for index in echoes.rounds:
        start = time.perf_counter_ns()
        result = rpc.rpc_sync(CALLEE, fns.echo, args=(echoes.tensor,))
        echoes.record(index, result, time.perf_counter_ns() - start)
        del result  # without keep_previous, not alive during the next echo
    return echoes.results()


def echo_rows(cfg: Config, *, keep_previous: bool) -> Results:
    """``echo_ms`` of each of ``cfg.sizes_mb``, keyed by size in MB."""
    return {
        str(nbytes // MB): echo_ms(cfg, nbytes, repeats, keep_previous=keep_previous)
        for nbytes, repeats in cfg.echo_sizes
    }


def calls(cfg: Config, job: WorkerArgs) -> Results:
    """The small-call rows, the memory probe and the plain tensor echo."""
    return {
        "noop_us": latency_us(cfg, fns.noop),
        "async_execution_noop_us": latency_us(cfg, fns.completed_future),
        "remote_to_here_us": remote_to_here_us(cfg),
        "rref_method_us": rref_method_us(cfg),
        "model_parallel_step_us": model_parallel_step_us(cfg),
        "state_dict_push_us": state_dict_push_us(cfg),
        "pipelined_calls_per_s": pipelined_rate(cfg),
        "noop_after_burst_us": latency_us(cfg, fns.noop),
        "memory": memory_probe(cfg),
        "echo_ms": echo_rows(cfg, keep_previous=False),
    }


def cold(cfg: Config, job: WorkerArgs) -> Results:
    """In a fresh pair: one no-op (it opens the connection), then the first echo of all."""
    assert job.size is not None
    tensor = make_tensor(job.size)
    start = time.perf_counter_ns()
    rpc.rpc_sync(CALLEE, fns.noop)
    noop_done = time.perf_counter_ns()
    result = rpc.rpc_sync(CALLEE, fns.echo, args=(tensor,))
    echo_done = time.perf_counter_ns()
    check_echo(tensor, result)
    return {
        "first_noop_ms": (noop_done - start) / 1e6,
        "first_echo_ms": (echo_done - noop_done) / 1e6,
    }


def steady(cfg: Config, job: WorkerArgs) -> Results:
    return {"echo_ms": echo_rows(cfg, keep_previous=True)}


def tcp(cfg: Config, job: WorkerArgs) -> Results:
    """Over TCP only (see ``main``): the first echo of ``job.size`` bytes of a fresh
    pair, then steady echoes of it with the previous result alive."""
    assert job.size is not None
    first = cold(cfg, job)
    repeats = dict(cfg.echo_sizes).get(job.size, cfg.bandwidth_repeats(job.size))
    return {**first, "echo_ms": echo_ms(cfg, job.size, repeats, keep_previous=True)}


def bandwidth(cfg: Config, job: WorkerArgs) -> Results:
    """Echo times along ``cfg.bandwidth_sizes``, up to ``job.size`` bytes."""
    assert job.size is not None
    return {
        size_label(nbytes): echo_ms(cfg, nbytes, cfg.bandwidth_repeats(nbytes), keep_previous=False)
        for nbytes in cfg.bandwidth_sizes
        if nbytes <= job.size
    }


def fanin(cfg: Config, job: WorkerArgs) -> Results:
    """One of ``job.clients`` clients, each with ``cfg.fanin_window`` no-ops in flight;
    every timed window starts when all clients are ready."""
    run_window(cfg, cfg.fanin_window, cfg.fanin_warmup)
    spans = []
    for _ in range(cfg.fanin_repeats):
        rpc.rpc_sync(CALLEE, fns.rendezvous, args=(job.clients,))
        spans.append(run_window(cfg, cfg.fanin_window, cfg.fanin_calls))
    return {"calls": cfg.fanin_calls, "spans_ns": spans}


def spread(cfg: Config, job: WorkerArgs) -> Results:
    """Percentiles of single sequential no-op round trips (µs), after a warm-up."""
    for _ in range(cfg.spread_warmup):
        rpc.rpc_sync(CALLEE, fns.noop)
    samples = []
    for _ in range(cfg.spread_calls):
        start = time.perf_counter_ns()
        rpc.rpc_sync(CALLEE, fns.noop)
        samples.append(ns_to_us(time.perf_counter_ns() - start, 1))
    return {"noop_us": percentiles(samples)}


WORKLOADS: dict[str, Callable[[Config, WorkerArgs], Results]] = {
    "calls": calls,
    "cold": cold,
    "steady": steady,
    "bandwidth": bandwidth,
    "fanin": fanin,
    "spread": spread,
    "tcp": tcp,
    "veth": tcp,  # the same, the two processes in two namespaces joined by a veth pair
}
TCP_ONLY: dict[str, Any] = {"_transports": ["uv"], "_channels": ["basic"]}
"""TensorPipe over TCP alone (no shared memory, no cross-memory attach): ``--workload tcp``/
``veth`` (across namespaces the driver sets ``TP_SOCKET_IFNAME`` to the namespace's veth end,
else TensorPipe listens on the hostname's address)."""


def main() -> None:
    # torch's own rpc.init_rpc/shutdown trigger this deprecation warning; it is not ours.
    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
    # torch's DistributedOptimizer wraps SGD in a TorchScript functional optimizer.
    warnings.filterwarnings("ignore", message="`TorchScript` support for functional optimizers")
    args = parse_worker_args()
    pin_to(args.cpu)
    cfg = config(args.quick)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=args.init_method,
        num_worker_threads=16,
        rpc_timeout=cfg.rpc_timeout,
        **(TCP_ONLY if args.tcp_only else {}),
    )
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        args.name, rank=args.rank, world_size=args.world_size, rpc_backend_options=options
    )
    try:
        if not args.serves:
            write_results(args.results_path, WORKLOADS[args.workload](cfg, args))
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
