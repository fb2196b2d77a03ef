"""Functions the benchmark calls remotely.

Both RPC frameworks send functions by reference (module and qualified name), so
these live at the top level of a module that both worker processes can import:
every worker runs a script from this directory, which puts it on ``sys.path``.
"""

from __future__ import annotations

import resource
import threading
from typing import Any

import torch
from _common import CLASSES, FEATURES
from torch.distributed import rpc


def noop() -> None:
    """A plain function: the callee runs it in its thread pool."""
    return None


async def coro_noop() -> None:
    """A coroutine function: asyncrpc runs it on the callee's event loop."""
    return None


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def completed_future() -> torch.futures.Future[None]:
    """torch's closest match to a coroutine no-op: an already-completed Future."""
    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return future


def add(a: int, b: int) -> int:
    """A tiny function with a small result: what ``remote()`` keeps on the callee."""
    return a + b


class Box:
    """A tiny object held on the callee through an RRef; ``get`` is a plain method."""

    def __init__(self, value: int = 7) -> None:
        self.value = value

    def get(self) -> int:
        return self.value


class Stage2(torch.nn.Module):
    """Stage 2 of the model-parallel MLP, made on the callee with ``remote()``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, FEATURES),
            torch.nn.ReLU(),
            torch.nn.Linear(FEATURES, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.net(x)
        return result

    def parameter_rrefs(self, framework: str) -> list[Any]:
        """RRefs of this stage's parameters, of ``framework``'s RRef class."""
        if framework == "asyncrpc":
            import asyncrpc

            return [asyncrpc.RRef(p) for p in self.parameters()]
        return [rpc.RRef(p) for p in self.parameters()]


def tensor_count(state: dict[str, torch.Tensor]) -> int:
    """What a parameter server answers a push of gradients with, in short: how many."""
    return len(state)


def echo(x: torch.Tensor) -> torch.Tensor:
    """Send the argument straight back."""
    return x


_barriers: dict[int, threading.Barrier] = {}
_barriers_lock = threading.Lock()
RENDEZVOUS_TIMEOUT_S = 120.0


def rendezvous(parties: int) -> None:
    """Return once ``parties`` callers are in here: the fan-in clients start together.

    A plain function, so each waiting caller holds one of the server's pool threads
    (both frameworks have 16, and at most 8 clients wait).
    """
    with _barriers_lock:
        barrier = _barriers.setdefault(parties, threading.Barrier(parties))
    barrier.wait(timeout=RENDEZVOUS_TIMEOUT_S)


def peak_rss_kb() -> int:
    """The callee's peak resident set size so far, in KiB (Linux ``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss_kb_after_receiving(x: torch.Tensor) -> int:
    """Peak RSS (KiB) once ``x`` has been received, rebuilt and read through, as a callee
    that uses its argument does (a receiver may map its pages only as they are read);
    ``x`` is not sent back."""
    float(x.sum())
    return peak_rss_kb()
