"""How every example starts its workers: on loopback by default, or under torchrun.

``launch(worker, parser)`` parses the command line and then either

* runs this process as one worker, when ``RANK`` and ``WORLD_SIZE`` are set (torchrun sets
  them, and so does the loopback spawner below): ``await worker(rank, world, args)`` on
  uvloop, with the worker expected to call ``asyncrpc.init_rpc(..., init_method="env://")``;
* or spawns ``world`` copies of the script on loopback, each with its ``RANK``, and waits
  for them.  If one fails, the others are stopped at once, so a broken run never hangs.

Every example takes ``--world`` (how many processes) and ``--smoke`` (a small, fast run
that still shows learning, used by the test suite).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import torch

import asyncrpc
from asyncrpc.rendezvous import free_port

Worker = Callable[[int, int, argparse.Namespace], Awaitable[None]]


async def trainer_and_ps(rank: int, world: int, run_trainer: Callable[[], Awaitable[None]]) -> None:
    """A two-worker job: rank 0 joins as ``trainer`` and runs ``run_trainer()``, rank 1
    joins as ``ps`` and serves; both then leave together."""
    if world != 2:
        raise SystemExit(f"this example runs 2 workers (trainer and ps), not {world}")
    name = "trainer" if rank == 0 else "ps"
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    if rank == 0:
        await run_trainer()
    await asyncrpc.shutdown()


def launch(worker: Worker, parser: argparse.ArgumentParser, *, timeout: float = 600.0) -> None:
    """Run ``worker`` as this process's rank, or spawn every rank on loopback."""
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run_one(worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        sys.exit(spawn_all(args.world, timeout))


def run_one(worker: Worker, rank: int, world: int, args: argparse.Namespace) -> None:
    """One worker: one thread of torch compute per process (the machine has few cores)."""
    import uvloop

    torch.manual_seed(getattr(args, "seed", 0) * 1000 + rank)
    torch.set_num_threads(1)
    uvloop.run(worker(rank, world, args))


def spawn_all(world: int, timeout: float) -> int:
    """Start ``world`` copies of this script with torchrun's variables; return the worst exit."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, *sys.argv]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r)}) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = "a worker failed" if failed else f"over {timeout:.0f}s"
                print(f"[launch] stopping the job: {why}", file=sys.stderr, flush=True)
                break
            _wait_any(procs, 0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    return max(codes, key=abs)


def _wait_any(procs: list[subprocess.Popen[bytes]], interval: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        next(p for p in procs if p.poll() is None).wait(timeout=interval)


def base_parser(description: str, *, world: int) -> argparse.ArgumentParser:
    """The options every example shares."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world", type=int, default=world, help="number of worker processes")
    parser.add_argument("--smoke", action="store_true", help="a small, fast run (for tests)")
    parser.add_argument("--seed", type=int, default=0)
    return parser
