"""What the workers of batch-service jobs do (see tests/cluster.py, test_serving_processes.py).

Run as ``run_job("serving_scenarios.NAME", world)``.  w0 is the client; the other
workers serve the batched function below.  Each scenario returns plain
observations; the tests make the assertions.  Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import batch
from asyncrpc.serving import Replicas
from tests.scenarios import Config

MAX_SIZE = 8


@batch(max_size=MAX_SIZE, max_wait=0.01)
def affine(items: list[torch.Tensor]) -> list[Any]:
    """One forward over the stacked items: each caller gets ``2x + 1`` and who served it."""
    out = torch.stack(items) * 2 + 1
    me = asyncrpc.get_worker_info().name
    return [(row, me) for row in out]


def batch_stats() -> dict[str, Any]:
    return affine.stats()


def getpid() -> int:
    return os.getpid()


async def _serve_until_shutdown(cfg: Config) -> dict[str, Any]:
    await asyncrpc.shutdown(timeout=60)
    return {}


async def batched_replicas_lose_one(cfg: Config) -> dict[str, Any]:
    """w0 calls ``affine`` on replicas w1 and w2 with 64 calls in flight, SIGKILLs w2
    half-way, and goes on to 400 calls; it counts every outcome."""
    await cfg.join(rpc_timeout=30)
    if cfg.rank != 0:
        return await _serve_until_shutdown(cfg)
    replicas = Replicas(["w1", "w2"])
    pid = await asyncrpc.rpc_async("w2", getpid)
    outcomes: Counter[str] = Counter()
    served_by: Counter[str] = Counter()
    wrong: list[int] = []
    after_kill: Counter[str] = Counter()
    killed = False

    async def one(i: int) -> None:
        issued_after_kill = killed
        x = torch.full((4,), float(i))
        try:
            y, who = await replicas.rpc_async(affine, args=(x,))
        except asyncrpc.PeerLostError:
            outcomes["lost"] += 1
            return
        outcomes["ok"] += 1
        served_by[who] += 1
        if issued_after_kill:
            after_kill[who] += 1
        if not torch.equal(y, x * 2 + 1):
            wrong.append(i)

    in_flight: set[asyncio.Task[None]] = set()
    for i in range(400):
        if i == 200:
            stats_before = {w: await asyncrpc.rpc_async(w, batch_stats) for w in ("w1", "w2")}
            os.kill(pid, signal.SIGKILL)
            killed = True
        if len(in_flight) >= 64:
            _, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        in_flight.add(asyncio.ensure_future(one(i)))
    async with asyncio.timeout(30):
        await asyncio.gather(*in_flight)
    seen = {
        "outcomes": dict(outcomes),
        "served_by": dict(served_by),
        "served_after_kill": dict(after_kill),
        "wrong": wrong,
        "live": replicas.live,
        "stats_before_kill": stats_before,
        "stats_w1_at_end": await asyncrpc.rpc_async("w1", batch_stats),
    }
    await asyncrpc.shutdown(timeout=20)
    return seen
