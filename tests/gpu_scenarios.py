"""CUDA tensors through a real two-process job (see tests/integration/test_gpu.py).

w0 maps ``cuda:0`` to w1's ``cuda:0`` (w1 configures nothing: replies and gradients
come back by the inverse, as in torch) and calls w1 with CUDA tensors: echoes of
several sizes, a tensor still being written by a kernel on a side stream when the
call is made, a call made while another stream spins (it must not be waited for),
a ``@batch`` function over CUDA items, an RRef holding a CUDA value, a distributed
backward, and a RemoteModule on ``w1/cuda:0`` trained by a DistributedOptimizer.
``config_errors``: a bad map and an unmapped tensor.  ``ASYNCRPC_TEST_CUDA_PATH`` picks the
path: ``ipc`` (the default: same host) or ``staged`` (``shared_memory=False``).
Returns observations; the test asserts.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch

import asyncrpc
from asyncrpc import autograd
from asyncrpc.functions import batch
from asyncrpc.nn import RemoteModule
from asyncrpc.optim import DistributedOptimizer
from asyncrpc.serde import cuda
from tests.scenarios import Config, echo

ECHO_BYTES = (1 << 10, 4 << 20, 64 << 20)
SPIN_CYCLES = int(4e9)  # torch.cuda._sleep: a few seconds of one GPU thread spinning


def device_and_sum(x: torch.Tensor) -> tuple[str, float]:
    return str(x.device), float(x.double().sum())


@batch(max_size=4, max_wait=0.05)
def tripled(items: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.stack(items) * 3)


def filled_on_device(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value, device="cuda")


def squared(x: torch.Tensor) -> torch.Tensor:
    return x * x


def cuda_stats() -> dict[str, Any]:
    return dict(asyncrpc.get_debug_info()["cuda"])


async def cuda_calls(cfg: Config) -> dict[str, Any]:
    staged = os.environ.get("ASYNCRPC_TEST_CUDA_PATH") == "staged"
    maps = {"w1": {"cuda:0": "cuda:0"}} if cfg.rank == 0 else {}
    await cfg.join(rpc_timeout=120, device_maps=maps, shared_memory=not staged)
    if cfg.rank != 0:
        await asyncrpc.shutdown()
        return {}
    seen: dict[str, Any] = {"echoes": await _echoes()}
    seen["side_stream"] = await _side_stream()
    seen["unrelated_stream"] = await _unrelated_stream_not_waited_for()
    items = [torch.full((8,), float(i), device="cuda") for i in range(8)]
    outs = await asyncio.gather(*(asyncrpc.rpc_async("w1", tripled, (t,)) for t in items))
    pairs = zip(outs, items, strict=True)
    seen["batch"] = all(o.is_cuda and torch.equal(o, t * 3) for o, t in pairs)
    value = await asyncrpc.remote("w1", filled_on_device, (1000, 2.0)).to_here()
    seen["rref"] = [str(value.device), float(value.sum())]
    seen["autograd"] = await _backward_through_cuda()
    seen["optimizer"] = await _remote_module_trained_on_cuda()
    seen["paths"] = [asyncrpc.get_debug_info()["cuda"], await asyncrpc.rpc_async("w1", cuda_stats)]
    await asyncrpc.shutdown()
    return seen


async def echo_on_the_loop(x: torch.Tensor) -> torch.Tensor:
    return x


async def exit_right_after_echoes(cfg: Config) -> dict[str, int]:
    """The caller's last calls echo a CUDA tensor by CUDA IPC, and both workers leave at
    once: the callee sent back memory it received (which carries a stream use) while
    the caller still keeps it open.  Returns each worker's CUDA counters at the end."""
    maps = {"w1": {"cuda:0": "cuda:0"}} if cfg.rank == 0 else {}
    await cfg.join(rpc_timeout=60, device_maps=maps)
    if cfg.rank == 0:
        x = torch.randn(1024, device="cuda")
        for function in (echo, echo_on_the_loop):
            if not torch.equal(await asyncrpc.rpc_async("w1", function, (x,)), x):
                raise AssertionError(f"the echo by {function.__name__} differs")
    await asyncrpc.shutdown()
    return cuda.stats()


async def _echoes() -> list[bool]:
    ok = []
    for nbytes in ECHO_BYTES:
        x = torch.randn(nbytes // 4, device="cuda")
        y = await asyncrpc.rpc_async("w1", echo, (x,))
        ok.append(y.device == x.device and torch.equal(y, x))
    return ok


async def _side_stream() -> list[Any]:
    """A tensor whose last kernel (on a side stream, behind ~1 s of GPU spinning) has
    not run when the call is made: the callee must see the filled values."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a = torch.zeros(1024, 1024, device="cuda")
        torch.cuda._sleep(int(1e9))
        a.fill_(7.0)
        device, total = await asyncrpc.rpc_async("w1", device_and_sum, (a,))
    return [device, total, 7.0 * a.numel()]


async def _unrelated_stream_not_waited_for() -> dict[str, Any]:
    """While another stream spins for seconds, a call with a tensor made on the current
    stream completes, and the spinning stream is still busy when its reply is in: no
    device-wide synchronisation on either side."""
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(SPIN_CYCLES)
    started = time.perf_counter()
    y = await asyncrpc.rpc_async("w1", echo, (x,))
    equal = bool(torch.equal(y, x))  # (waits for the current stream only)
    took = time.perf_counter() - started
    still_busy = not busy.query()
    busy.synchronize()
    spin = time.perf_counter() - started
    return {"equal": equal, "still_busy": still_busy, "call_s": took, "spin_s": spin}


async def _backward_through_cuda() -> bool:
    x = torch.randn(100, device="cuda", requires_grad=True)
    async with autograd.context() as ctx:
        y = await asyncrpc.rpc_async("w1", squared, (x,))
        await autograd.backward(ctx, [y.sum()])
        grad = autograd.get_gradients(ctx)[x]
    return bool(grad.is_cuda and torch.allclose(grad, 2 * x.detach()))


async def _remote_module_trained_on_cuda() -> dict[str, Any]:
    """One SGD step of a Linear on w1's GPU, against the same step taken locally."""
    torch.manual_seed(0)
    local = torch.nn.Linear(16, 4).cuda()
    remote = RemoteModule("w1/cuda:0", torch.nn.Linear, (16, 4))
    state = {k: v.detach().cuda() for k, v in local.state_dict().items()}
    await asyncrpc.rpc_async("w1", _load_state, (remote.get_module_rref(), state))
    opt = DistributedOptimizer(torch.optim.SGD, await remote.remote_parameters(), lr=0.1)
    x = torch.randn(8, 16, device="cuda")
    async with autograd.context() as ctx:
        out = await remote.forward_async(x)
        await autograd.backward(ctx, [out.square().sum()])
        await opt.step(ctx)
    local.weight.grad = None
    local(x).square().sum().backward()
    with torch.no_grad():
        local.weight -= 0.1 * local.weight.grad  # type: ignore[operator]
    after = await asyncrpc.rpc_async("w1", _weight_of, (remote.get_module_rref(),))
    return {"device": str(after.device), "equal": bool(torch.allclose(after, local.weight))}


def _load_state(module: asyncrpc.RRef[torch.nn.Module], state: dict[str, Any]) -> None:
    module.local_value().load_state_dict(state)


def _weight_of(module: asyncrpc.RRef[torch.nn.Module]) -> torch.Tensor:
    return module.local_value().weight.detach().clone()  # type: ignore[operator]


async def config_errors(cfg: Config) -> dict[str, str]:
    """A map naming a device the peer lacks fails init_rpc on every worker; in a job
    without maps, a CUDA tensor is refused before anything is sent."""
    seen = {}
    bad = {"w1": {"cuda:0": f"cuda:{torch.cuda.device_count()}"}} if cfg.rank == 0 else {}
    try:
        await cfg.join(rpc_timeout=60, device_maps=bad)
    except ValueError as exc:
        seen["init"] = str(exc)
    cfg.port += 1  # (a fresh store for the second job: see tests/integration/test_gpu.py)
    await cfg.join(rpc_timeout=60)
    if cfg.rank == 0:
        try:
            asyncrpc.rpc_async("w1", echo, (torch.ones(1, device="cuda"),))
            seen["unmapped"] = "not refused"
        except asyncrpc.SerializationError as exc:
            seen["unmapped"] = str(exc)
    await asyncrpc.shutdown()
    return seen
