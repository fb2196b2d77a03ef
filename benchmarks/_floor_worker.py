"""One worker of the benchmark's ``floor``: its small-call workloads over the skeleton RPC.

``bench_rpc.py`` runs this beside torch's and asyncrpc's workers, in the same rounds, for
the workloads whose targets are about the framework's own work per call (``calls``,
``spread`` and ``fanin``).  It shows what a Python RPC cannot go below on this machine, measured the
same way: the same counts, the same fresh pair of processes, the same clock.

* The server (the last rank) serves the skeleton (``_skeleton.py``) on a Unix socket in
  the job's folder, one connection per caller and one thread pool for all, its loop
  busy-polling as asyncrpc's does by default (while the host has a CPU per process).
* The caller (rank 0) times ``calls``: the plain and the coroutine no-op (sequential,
  its loop busy-polling), the pipelined no-op (``window`` in flight, a semaphore and a
  done callback per call, as both frameworks' workers do), and the model-parallel step
  twice: over the skeleton (stage 2 on the server, the step's three round trips -- the
  forward in a pool thread, as a user's function runs, the backward and the SGD step on
  the server's loop -- with tensors as numpy arrays in the pickles and autograd run by
  hand at each end), and with no RPC at all (both stages in this process: the step's
  own compute, which no framework can go below).  ``spread`` times single
  plain no-ops as the frameworks' spread job does, and ``fanin`` (N callers) keeps
  ``fanin_window`` plain no-ops in flight from each, windows started together.

It writes the same keys as the frameworks' workers for these rows; the rest it has no
floor for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import uvloop
from _common import (
    Config,
    Results,
    WorkerArgs,
    config,
    make_batch,
    make_stage1,
    ns_to_us,
    parse_worker_args,
    percentiles,
    pin_to,
    sequential_us,
    summary,
    trained_step_us,
    write_results,
)
from _remote_fns import Stage2
from _skeleton import (
    SkeletonClient,
    SkeletonPool,
    SkeletonServer,
    Spinner,
    coroutine_noop,
    plain_noop,
    rendezvous,
)
from torch.nn.functional import cross_entropy

WORKLOADS = ("calls", "spread", "fanin")
"""The workloads this side has a floor for."""


def socket_path(out: Path) -> Path:
    return out / "floor.sock"


# -- the server ---------------------------------------------------------------------------


async def serve(job: WorkerArgs, limit_s: float) -> None:
    """Serve every caller until the last one hangs up (or ``limit_s`` passes)."""
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path(job.out)))
    listener.listen(job.clients)
    listener.setblocking(False)
    pool, open_connections = SkeletonPool(loop), job.clients

    def lost() -> None:
        nonlocal open_connections
        open_connections -= 1
        if not open_connections:
            loop.stop()

    for _ in range(job.clients):
        connection, _ = await asyncio.wait_for(loop.sock_accept(listener), limit_s)
        await loop.connect_accepted_socket(lambda: SkeletonServer(pool, lost), connection)
    listener.close()
    if job.world_size <= (os.cpu_count() or 1):  # as asyncrpc's poller: a CPU each
        Spinner(loop).start()
    await asyncio.sleep(limit_s)  # stopped when the last caller hangs up


def run_server(job: WorkerArgs, limit_s: float) -> None:
    with contextlib.suppress(RuntimeError):  # "Event loop stopped": the caller hung up
        uvloop.run(serve(job, limit_s))


# -- the caller ---------------------------------------------------------------------------


async def connect(job: WorkerArgs, limit_s: float) -> SkeletonClient:
    """The skeleton's client, once the server listens (it starts beside this process)."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + limit_s
    while True:
        try:
            _, caller = await loop.create_unix_connection(
                lambda: SkeletonClient(plain_noop), str(socket_path(job.out))
            )
            return caller
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the floor's server did not listen within {limit_s}s") from None
            await asyncio.sleep(0.01)


def caller_of(caller: SkeletonClient, function: Callable[..., Any]) -> Callable[..., Any]:
    """Calls of ``function`` on the server: ``once(*args)`` is a future of its result."""

    def once(*args: Any) -> asyncio.Future[Any]:
        caller.function = function
        return caller.call(*args)

    return once


async def run_window(caller: SkeletonClient, window: int, calls: int) -> tuple[int, int]:
    """Plain no-ops, ``window`` in flight, as the frameworks' workers run them; returns
    (start, end) in ``time.monotonic_ns()``, a clock all processes of the host share."""
    caller.function = plain_noop
    slots = asyncio.Semaphore(window)
    start = time.monotonic_ns()
    for _ in range(calls):
        await slots.acquire()
        caller.call().add_done_callback(lambda _: slots.release())
    for _ in range(window):
        await slots.acquire()
    return start, time.monotonic_ns()


async def pipelined_rate(cfg: Config, caller: SkeletonClient) -> Results:
    await run_window(caller, cfg.window, cfg.pipelined_warmup)
    rates = []
    for _ in range(cfg.pipelined_repeats):
        start, end = await run_window(caller, cfg.window, cfg.pipelined_calls)
        rates.append(cfg.pipelined_calls / ((end - start) / 1e9))
    return summary(rates)


def local_step() -> Callable[[], Awaitable[torch.Tensor]]:
    """The model-parallel step with both stages here: its compute alone."""
    stage1, stage2 = make_stage1(), Stage2()
    opt = torch.optim.SGD([*stage1.parameters(), *stage2.parameters()], lr=0.01)
    x, y = make_batch()

    async def step() -> torch.Tensor:
        opt.zero_grad()
        loss = cross_entropy(stage2(stage1(x)), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


class ServedStage:
    """The server's half of the skeleton's model-parallel step: stage 2, its optimizer,
    and the tensors of the step in progress (steps come one at a time)."""

    stage: Stage2 | None = None
    optimizer: torch.optim.Optimizer | None = None
    received: torch.Tensor | None = None  # the activation, a leaf that requires grad
    output: torch.Tensor | None = None

    @classmethod
    def made(cls) -> type[ServedStage]:
        if cls.stage is None:
            cls.stage = Stage2()
            cls.optimizer = torch.optim.SGD(cls.stage.parameters(), lr=0.01)
        return cls


def stage2_forward(activation: np.ndarray) -> np.ndarray:
    """Server, in a pool thread (a user's forward): stage 2 on the activation."""
    served = ServedStage.made()
    assert served.stage is not None
    served.received = torch.from_numpy(activation).requires_grad_()
    served.output = served.stage(served.received)
    result: np.ndarray = served.output.detach().numpy()
    return result


async def stage2_backward(grad_output: np.ndarray) -> np.ndarray:
    """Server, on its loop: stage 2's backward; the activation's gradient."""
    served = ServedStage.made()
    assert served.output is not None and served.received is not None
    served.output.backward(torch.from_numpy(grad_output))
    assert served.received.grad is not None
    grad: np.ndarray = served.received.grad.numpy()
    served.output = served.received = None
    return grad


async def stage2_step() -> None:
    """Server, on its loop: stage 2's SGD step."""
    optimizer = ServedStage.made().optimizer
    assert optimizer is not None
    optimizer.step()
    optimizer.zero_grad()


def remote_step(caller: SkeletonClient) -> Callable[[], Awaitable[torch.Tensor]]:
    """The model-parallel step over the skeleton: stage 1 here, stage 2 on the server."""
    stage1 = make_stage1()
    optimizer = torch.optim.SGD(stage1.parameters(), lr=0.01)
    x, y = make_batch()
    forward, backward, step_there = (
        caller_of(caller, f) for f in (stage2_forward, stage2_backward, stage2_step)
    )

    async def step() -> torch.Tensor:
        optimizer.zero_grad()
        activation = stage1(x)
        output = torch.from_numpy(await forward(activation.detach().numpy()))
        output.requires_grad_()
        loss = cross_entropy(output, y)
        loss.backward()
        assert output.grad is not None
        activation.backward(torch.from_numpy(await backward(output.grad.numpy())))
        stepped = step_there()  # both optimizers step at once, as DistributedOptimizer's
        optimizer.step()
        await stepped
        return loss.detach()

    return step


async def calls(cfg: Config, job: WorkerArgs) -> Results:
    compute = await trained_step_us(cfg, local_step())  # before the server spins
    caller = await connect(job, cfg.rpc_timeout)
    pipelined = await pipelined_rate(cfg, caller)
    spinner = Spinner(asyncio.get_running_loop())
    spinner.start()
    results = {
        "noop_us": await sequential_us(cfg, caller_of(caller, plain_noop)),
        "coroutine_noop_us": await sequential_us(cfg, caller_of(caller, coroutine_noop)),
        "pipelined_calls_per_s": pipelined,
        "model_parallel_step_us": await trained_step_us(cfg, remote_step(caller)),
        "step_compute_us": compute,
    }
    spinner.stop()
    caller.transport.close()
    return results


async def spread(cfg: Config, job: WorkerArgs) -> Results:
    caller = await connect(job, cfg.rpc_timeout)
    Spinner(asyncio.get_running_loop()).start()
    for _ in range(cfg.spread_warmup):
        await caller.call()
    samples = []
    for _ in range(cfg.spread_calls):
        start = time.perf_counter_ns()
        await caller.call()
        samples.append(ns_to_us(time.perf_counter_ns() - start, 1))
    caller.transport.close()
    return {"noop_us": percentiles(samples)}


async def fanin(cfg: Config, job: WorkerArgs) -> Results:
    """One of ``job.clients`` clients, each with ``cfg.fanin_window`` no-ops in flight;
    every timed window starts when all clients are ready."""
    caller = await connect(job, cfg.rpc_timeout)
    await run_window(caller, cfg.fanin_window, cfg.fanin_warmup)
    spans = []
    for _ in range(cfg.fanin_repeats):
        caller.function = rendezvous
        await caller.call(job.clients)
        spans.append(await run_window(caller, cfg.fanin_window, cfg.fanin_calls))
    caller.transport.close()
    return {"calls": cfg.fanin_calls, "spans_ns": spans}


def main() -> None:
    job = parse_worker_args()
    pin_to(job.cpu)
    cfg = config(job.quick)
    if job.workload not in WORKLOADS:
        raise SystemExit(f"the floor has no {job.workload!r} workload")
    limit_s = cfg.rpc_timeout + cfg.step_timeout
    if job.serves:
        run_server(job, limit_s)
        return
    workload = {"calls": calls, "spread": spread, "fanin": fanin}[job.workload]
    write_results(job.results_path, uvloop.run(asyncio.wait_for(workload(cfg, job), limit_s)))


if __name__ == "__main__":
    main()
