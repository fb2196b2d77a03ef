"""A worker of a torchrun job that restarts: in the first attempt (restart count 0) the
last rank dies right after ``init_rpc``, leaving its job's keys in torchrun's store; in
the next attempt every rank must meet afresh, call its neighbour, and print RESULT.
Run by tests/integration/test_rendezvous.py."""

from __future__ import annotations

import asyncio
import os

import asyncrpc


def who() -> str:
    return asyncrpc.get_worker_info().name


async def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    await asyncrpc.init_rpc(f"w{rank}", rpc_timeout=30)
    print(f"attempt {attempt}: rank {rank} joined", flush=True)
    if attempt == 0 and rank == world - 1:
        os._exit(3)  # a crash: no shutdown, its keys stay in the store
    peer = await asyncrpc.rpc_async(f"w{(rank + 1) % world}", who)
    print(f"RESULT attempt={attempt} rank={rank} peer={peer}", flush=True)
    await asyncrpc.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
