"""What the workers of RRef integration-test jobs do (see tests/cluster.py).

Run as ``run_job("rref_scenarios.NAME", world)``.  Remote functions and classes
live here at module level so they travel by reference.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import torch

import asyncrpc
from asyncrpc.agent import current_agent
from asyncrpc.autograd.context import contexts_of
from tests.scenarios import Config, block_for, die, outcome

KEPT: list[Any] = []  # handles a worker keeps until it dies or shuts down


# -- remote functions ---------------------------------------------------------------


def make_value(i: int) -> int:
    return i * 10


async def relay(refs: list[asyncrpc.RRef[int]], via: str) -> list[Any]:
    """Pass the handles on to ``via`` (in a request) and return what came back plus the
    originals (in our reply): forks in every direction, in both lanes."""
    returned = await asyncrpc.rpc_async(via, pass_back, args=(refs,))
    return [returned, refs]


def pass_back(refs: list[asyncrpc.RRef[int]]) -> list[asyncrpc.RRef[int]]:
    return refs


async def sample_values(refs: list[asyncrpc.RRef[int]]) -> list[int]:
    return list(await asyncio.gather(*(r.to_here() for r in refs)))


def rref_counts() -> dict[str, int]:
    gc.collect()
    info = asyncrpc.get_debug_info()
    return {"owner_rrefs": info["owner_rrefs"], "user_rrefs": info["user_rrefs"]}


def keep(rref: asyncrpc.RRef[Any]) -> str:
    KEPT.append(rref)
    return rref.owner_name()


def keep_all(refs: list[asyncrpc.RRef[Any]]) -> int:
    KEPT.extend(refs)
    return len(KEPT)


async def use_kept() -> Any:
    return await outcome(KEPT[0].to_here())


class ParameterServer:
    def __init__(self, size: int) -> None:
        self.weights = torch.zeros(size)
        self.pushes = 0
        # Pushes run in the owner's thread pool, several at once: an in-place add is a
        # read-modify-write that drops updates when two threads interleave (as in torch).
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # (to_here() sends it back, lock aside)
        return {"weights": self.weights, "pushes": self.pushes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    def push(self, grad: torch.Tensor) -> int:
        with self.lock:
            self.weights += grad
            self.pushes += 1
            return self.pushes

    async def pull(self) -> torch.Tensor:
        return self.weights.clone()

    def slow(self, seconds: float) -> float:
        return block_for(seconds)


async def train(ps: asyncrpc.RRef[ParameterServer], steps: int) -> float:
    """A trainer: many concurrent pushes through the shared handle, and pulls."""
    rank = asyncrpc.get_worker_info().id
    for _ in range(steps // 10):
        grads = [torch.full((4,), float(rank)) for _ in range(10)]
        await asyncio.gather(*(ps.rpc_async().push(g) for g in grads))
        await ps.rpc_async().pull()
    return float((await ps.rpc_async().pull()).sum())


# -- helpers ----------------------------------------------------------------------------


async def counts_when_settled(world: int, limit: float = 30.0) -> list[dict[str, int]]:
    """Every worker's RRef counts, once all are zero (or as they stand at ``limit``).
    Each round asks every worker over RPC, so no round is a blind wait."""
    deadline = time.monotonic() + limit
    while True:
        counts = [await asyncrpc.rpc_async(f"w{r}", rref_counts) for r in range(world)]
        if all(c == {"owner_rrefs": 0, "user_rrefs": 0} for c in counts):
            return counts
        if time.monotonic() > deadline:
            return counts


# -- scenarios --------------------------------------------------------------------------


async def churn(cfg: Config) -> dict[str, Any]:
    """10,000 RRefs (owned by w0 and w1) forked through w2 and back, then dropped."""
    await cfg.join(rpc_timeout=60)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        made, checked, owners_kept = 0, [], True
        for batch in range(20):
            refs: list[Any] = [asyncrpc.remote("w1", make_value, args=(i,)) for i in range(250)]
            refs += [asyncrpc.RRef(i * 10) for i in range(250, 500)]
            returned, originals = await asyncrpc.rpc_async("w2", relay, args=(refs, "w1"))
            pairs = zip(returned, refs, strict=True)
            owners_kept &= all(r.owner_name() == o.owner_name() for r, o in pairs)
            if batch % 5 == 0:
                checked += await asyncrpc.rpc_async("w2", sample_values, args=(returned[::50],))
            made += len(refs)
            del refs, returned, originals
        seen["made"] = made
        seen["owners_kept"] = owners_kept
        seen["checked"] = checked
        seen["counts"] = await counts_when_settled(cfg.world)
    await asyncrpc.shutdown()
    return seen


async def parameter_server(cfg: Config) -> dict[str, Any]:
    """w0 makes a server on w1 and hands it to trainers w2, w3, which push concurrently."""
    await cfg.join(rpc_timeout=60)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        ps = asyncrpc.remote("w1", ParameterServer, args=(4,))
        trainers = [f"w{r}" for r in range(2, cfg.world)]
        sums = await asyncio.gather(
            *(asyncrpc.rpc_async(t, train, args=(ps, 100)) for t in trainers)
        )
        final = await ps.to_here()
        seen["pushes"] = final.pushes
        seen["weights"] = final.weights.tolist()
        seen["trainer_sums"] = sums
        del ps, final
        seen["counts"] = await counts_when_settled(cfg.world)
    await asyncrpc.shutdown()
    return seen


async def owner_killed(cfg: Config) -> dict[str, Any]:
    """w1 owns an RRef that w0 and w2 hold, and dies while w0 is using it."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        ps = asyncrpc.remote("w1", ParameterServer, args=(2,))
        seen["kept_by_w2"] = await asyncrpc.rpc_async("w2", keep, args=(ps,))
        in_use = ps.rpc_async().slow(25)
        started = time.monotonic()
        seen["killed"] = await outcome(asyncrpc.rpc_async("w1", die))
        seen["in_use"] = await outcome(in_use)
        seen["later"] = await outcome(ps.to_here())
        seen["proxy_later"] = await outcome(ps.rpc_async().pull())
        seen["on_w2"] = await asyncrpc.rpc_async("w2", use_kept)
        seen["elapsed"] = time.monotonic() - started
        started = time.monotonic()
        await asyncrpc.shutdown(timeout=20)
        seen["shutdown_seconds"] = time.monotonic() - started
    elif cfg.rank == 1:
        await asyncio.sleep(60)  # killed long before
    else:
        await asyncrpc.shutdown(timeout=20)
    return seen


async def user_killed(cfg: Config) -> dict[str, Any]:
    """w0 owns a value that w1 holds; w1 dies; w0 frees the value."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        seen["kept_by_w1"] = await asyncrpc.rpc_async("w1", keep, args=(asyncrpc.RRef(7),))
        seen["before"] = rref_counts()
        await outcome(asyncrpc.rpc_async("w1", die))
        deadline = time.monotonic() + 10
        while rref_counts()["owner_rrefs"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polls the condition, bounded by the deadline
        seen["after"] = rref_counts()
        await asyncrpc.shutdown(timeout=20)
    else:
        await asyncio.sleep(60)  # killed long before
    return seen


async def held_at_shutdown(cfg: Config) -> dict[str, Any]:
    """Every worker still holds handles when it shuts down (w1 owns most values)."""
    await cfg.join(rpc_timeout=30)
    seen: dict[str, Any] = {}
    agent = current_agent()
    if cfg.rank == 0:
        KEPT.extend(asyncrpc.remote("w1", make_value, args=(i,)) for i in range(50))
        seen["kept_by_w2"] = await asyncrpc.rpc_async("w2", keep_all, args=(KEPT[:10],))
        seen["kept_by_w1"] = await asyncrpc.rpc_async("w1", keep, args=(asyncrpc.RRef(1),))
        seen["before"] = await asyncrpc.rpc_async("w1", rref_counts)
    started = time.monotonic()
    await asyncrpc.shutdown(timeout=20)
    seen["shutdown_seconds"] = time.monotonic() - started
    assert agent is not None
    left = agent.closing_debug_info  # after both barriers, just before closing
    seen["left"] = {"owner_rrefs": left["owner_rrefs"], "user_rrefs": left["user_rrefs"]}
    return seen


# -- distributed autograd across processes ---------------------------------------------


class LinearServer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        return [asyncrpc.RRef(p) for p in self.model.parameters()]


def contexts_here() -> int:
    return int(asyncrpc.get_debug_info()["autograd_contexts"])


async def fit(server: asyncrpc.RRef[LinearServer], steps: int) -> list[float]:
    """A trainer: its own context per step against the shared server."""
    generator = torch.Generator().manual_seed(asyncrpc.get_worker_info().id)
    true_w = torch.arange(8, dtype=torch.float32)
    params = await server.rpc_async().parameter_rrefs()
    opt = asyncrpc.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator)
        async with asyncrpc.autograd.context() as ctx:
            loss = ((await server.rpc_async().forward(x)).squeeze(1) - x @ true_w).pow(2).mean()
            await asyncrpc.autograd.backward(ctx, [loss])
            await opt.step(ctx)
        losses.append(loss.item())
    agent = current_agent()
    assert agent is not None
    await contexts_of(agent).released()  # context exits do not wait for the server's
    return losses


async def trainers_share_a_server(cfg: Config) -> dict[str, Any]:
    """w0 makes a server; w1..w3 train it at once, each with its own contexts."""
    await cfg.join(rpc_timeout=60)
    seen: dict[str, Any] = {}
    if cfg.rank == 0:
        server = asyncrpc.remote("w0", LinearServer)
        trainers = [f"w{r}" for r in range(1, cfg.world)]
        losses = await asyncio.gather(
            *(asyncrpc.rpc_async(t, fit, args=(server, 40)) for t in trainers)
        )
        seen["losses"] = losses
        seen["contexts"] = [
            await asyncrpc.rpc_async(f"w{r}", contexts_here) for r in range(cfg.world)
        ]
    await asyncrpc.shutdown()
    return seen
