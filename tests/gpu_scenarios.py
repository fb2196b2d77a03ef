"""CUDA tensors through a real two-process job (see tests/integration/test_gpu.py).

w0 calls w1 with CUDA tensors: echoes of several sizes, a tensor still being written by
a kernel on a side stream when the call is made, a ``@batch`` function over CUDA items,
an RRef holding a CUDA value, and a distributed backward through a CUDA tensor.  It
returns observations; the test asserts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

import asyncrpc
from asyncrpc import autograd
from asyncrpc.functions import batch
from tests.scenarios import Config, echo

ECHO_BYTES = (1 << 10, 4 << 20, 64 << 20)


def device_and_sum(x: torch.Tensor) -> tuple[str, float]:
    return str(x.device), float(x.double().sum())


@batch(max_size=4, max_wait=0.05)
def tripled(items: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.stack(items) * 3)


def filled_on_device(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value, device="cuda")


def squared(x: torch.Tensor) -> torch.Tensor:
    return x * x


async def cuda_calls(cfg: Config) -> dict[str, Any]:
    await cfg.join(rpc_timeout=120)
    if cfg.rank != 0:
        await asyncrpc.shutdown()
        return {}
    seen: dict[str, Any] = {"echoes": await _echoes()}
    seen["side_stream"] = await _side_stream()
    items = [torch.full((8,), float(i), device="cuda") for i in range(8)]
    outs = await asyncio.gather(*(asyncrpc.rpc_async("w1", tripled, (t,)) for t in items))
    pairs = zip(outs, items, strict=True)
    seen["batch"] = all(o.is_cuda and torch.equal(o, t * 3) for o, t in pairs)
    value = await asyncrpc.remote("w1", filled_on_device, (1000, 2.0)).to_here()
    seen["rref"] = [str(value.device), float(value.sum())]
    seen["autograd"] = await _backward_through_cuda()
    await asyncrpc.shutdown()
    return seen


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


async def _backward_through_cuda() -> bool:
    x = torch.randn(100, device="cuda", requires_grad=True)
    async with autograd.context() as ctx:
        y = await asyncrpc.rpc_async("w1", squared, (x,))
        await autograd.backward(ctx, [y.sum()])
        grad = autograd.get_gradients(ctx)[x]
    return bool(grad.is_cuda and torch.allclose(grad, 2 * x.detach()))
