"""Functions and classes the soak workers call on each other (see soak.py).

Functions travel by reference (module and qualified name), so they live at the top
level of a module every worker imports: each worker runs a script from this
directory, which puts it on ``sys.path``.
"""

from __future__ import annotations

import asyncio

import torch

import asyncrpc

FEATURES, CLASSES, BATCH = 64, 8, 16


def noop() -> None:
    """A plain function: the callee's thread pool."""
    return None


async def coro_noop() -> None:
    """An ``async def``: the callee's event loop."""
    return None


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def fail(message: str) -> None:
    """Raises on purpose: the soak expects this ValueError back."""
    raise ValueError(message)


async def sleep_for(seconds: float) -> float:
    """Outlives the short timeout the soak gives it: the call is expected to time out."""
    await asyncio.sleep(seconds)
    return seconds


async def total_of(rref: asyncrpc.RRef[Accumulator]) -> float:
    """Use an RRef received from another worker (a fork): a method call to its owner."""
    return float(await rref.rpc_async().total())


async def sum_of(rref: asyncrpc.RRef[torch.Tensor]) -> float:
    """Fetch a tensor through an RRef its owner (the caller) passed us."""
    return float((await rref.to_here()).sum())


class Accumulator:
    """A value held through ``remote()``: a tensor that ``add`` grows."""

    def __init__(self, start: torch.Tensor) -> None:
        self.value = start.clone()

    def add(self, x: torch.Tensor) -> int:
        self.value += x
        return int(self.value.numel())

    async def total(self) -> float:
        return float(self.value.sum())


class Stage(torch.nn.Module):
    """The remote half of a two-stage model trained with distributed autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, FEATURES), torch.nn.ReLU(), torch.nn.Linear(FEATURES, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.net(x)
        return result

    def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        return [asyncrpc.RRef(p) for p in self.parameters()]
