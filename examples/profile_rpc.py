"""RPC calls in torch.profiler traces: a few steps of model-parallel training, profiled.

Two workers: the ``trainer`` holds the data and the model's head; the ``ps`` holds its
body (``asyncrpc.remote``), used through an RRef.  Each step runs in a distributed
autograd context: the forward pass crosses to ``ps`` and back, the backward pass
crosses back to it, and a ``DistributedOptimizer`` steps both halves.

After a few warm-up steps, both workers profile the next steps with
``torch.profiler.profile`` (the trainer asks the ps to start and stop; each profiler
runs on its worker's event loop thread, so both trace that thread) and each writes
its own chrome trace, ``trace-<worker>.json``, in ``--out`` (default: a new temporary
folder, printed).  Open both in https://ui.perfetto.dev or ``chrome://tracing``:

* the trainer's ``rpc_async#<function> -> ps [call N@trainer]`` spans run from each
  ``rpc_async`` to its reply;
* the ps's ``rpc_queued#<function> <- trainer [call N@trainer]`` (arrival until the
  function starts; a pool call: until a pool thread takes it) and
  ``rpc_run#<function> <- trainer [call N@trainer]`` (until the reply is about to be written)
  carry the same call tag, and the same for calls the other way.

The trainer then reads both traces back, matches the spans of each call, and prints
``RESULT spans_matched=`` (calls seen on both sides), ``RESULT calls_unmatched=`` (its
calls to the ps without the ps's spans: 0) and ``RESULT run_within_call=`` (the share
of matched calls whose callee run span is no longer than the caller's span: 1).
``--all-threads`` profiles every thread (the pool's too:
``_ExperimentalConfig(profile_all_threads=True)``).

    python examples/profile_rpc.py --out traces   # spawns its 2 workers on loopback
    python examples/profile_rpc.py --smoke        # a short run for the tests
    torchrun --nproc-per-node 2 examples/profile_rpc.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from _launch import base_parser, launch, trainer_and_ps
from torch import nn

import asyncrpc
from asyncrpc.agent import on_loop
from asyncrpc.agent.spans import CALLER, QUEUED, RUN, match_calls
from asyncrpc.autograd import backward, context
from asyncrpc.optim import DistributedOptimizer

FEATURES, HIDDEN, CLASSES = 32, 256, 4


class Body(nn.Module):
    """The model's body, on the ps: its forward runs in the ps's thread pool."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)

    async def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        return [asyncrpc.RRef(p) for p in self.parameters()]


# -- the ps's profiler, started and stopped by the trainer ------------------------------

_profiler: list[torch.profiler.profile] = []
_written: list[asyncio.Future[str]] = []


def new_profiler(all_threads: bool) -> torch.profiler.profile:
    """A CPU profiler; ``all_threads``: every thread of the process, not only this one."""
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=all_threads)
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config
    )


async def start_profiling(all_threads: bool) -> None:
    """On the ps, on its loop thread (an ``async def``): start its profiler."""
    _profiler.append(new_profiler(all_threads))
    _written.append(asyncio.get_running_loop().create_future())
    _profiler[0].start()


@on_loop
def stop_profiling(path: str) -> None:
    """On the ps: stop its profiler and write its trace to ``path`` right after this
    call's reply has left (so that the call's own spans are finished in the trace)."""
    asyncio.get_running_loop().call_soon(_stop_and_export, path)


def _stop_and_export(path: str) -> None:
    _profiler[0].stop()
    _profiler[0].export_chrome_trace(path)
    _written[0].set_result(path)


async def trace_written() -> str:
    """On the ps: the path of its trace, once written."""
    return await _written[0]


# -- training on the trainer ---------------------------------------------------------------


class Model:
    """The body on the ps (through its RRef), the head here."""

    def __init__(self) -> None:
        self.body = asyncrpc.remote("ps", Body)
        self.head = nn.Linear(HIDDEN, CLASSES)

    async def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(await self.body.rpc_async().forward(x))

    async def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        remote = await self.body.rpc_async().parameter_rrefs()
        return [*remote, *(asyncrpc.RRef(p) for p in self.head.parameters())]


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: the class is the arg max of a fixed projection of the inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=gen)
    return x, (x @ torch.randn(FEATURES, CLASSES, generator=gen)).argmax(dim=1)


async def train_step(
    model: Model, opt: DistributedOptimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    async with context() as ctx:
        loss = nn.functional.cross_entropy(await model.forward(x), y)
        await backward(ctx, [loss])
        await opt.step(ctx)
    return loss.item()


async def train(model: Model, opt: DistributedOptimizer, steps: int, batch: int) -> list[float]:
    x, y = make_data(steps * batch, seed=steps)
    losses = []
    for i in range(steps):
        rows = slice(i * batch, (i + 1) * batch)
        losses.append(await train_step(model, opt, x[rows], y[rows]))
    return losses


async def run_trainer(args: argparse.Namespace) -> None:
    out = Path(args.out or tempfile.mkdtemp(prefix="asyncrpc-traces-"))
    out.mkdir(parents=True, exist_ok=True)
    model = Model()
    opt = DistributedOptimizer(torch.optim.Adam, await model.parameter_rrefs(), lr=1e-3)
    warmup, steps = (2, 3) if args.smoke else (args.warmup, args.steps)
    await train(model, opt, warmup, args.batch)  # one-off costs stay out of the traces
    await asyncrpc.rpc_async("ps", start_profiling, (args.all_threads,))
    with new_profiler(args.all_threads) as prof:
        losses = await train(model, opt, steps, args.batch)
    ours = out / "trace-trainer.json"
    prof.export_chrome_trace(str(ours))
    await asyncrpc.rpc_async("ps", stop_profiling, (str(out / "trace-ps.json"),))
    theirs = Path(await asyncrpc.rpc_async("ps", trace_written))
    say(f"[trainer] {steps} profiled steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    say(f"[trainer] traces: {ours} and {theirs}")
    report(match_calls(*(json.loads(p.read_text()) for p in (ours, theirs))))


def report(calls: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Print the RESULT lines: the trainer's calls to the ps, matched span by span."""
    ours = {tag: kinds for tag, kinds in calls.items() if tag.endswith("@trainer")}
    to_ps = {tag: k for tag, k in ours.items() if CALLER in k and "-> ps " in k[CALLER]["name"]}
    matched = {tag: k for tag, k in calls.items() if {CALLER, QUEUED, RUN} <= k.keys()}
    within = [k[RUN]["dur"] <= k[CALLER]["dur"] for k in matched.values()]
    for tag, kinds in list(matched.items())[:3]:
        say(
            f"[trainer] call {tag}: "
            + ", ".join(f"{k} {e['dur']:.0f} us" for k, e in kinds.items())
        )
    print(f"RESULT spans_matched={len(matched)}", flush=True)
    print(f"RESULT calls_unmatched={len(to_ps.keys() - matched.keys())}", flush=True)
    print(f"RESULT run_within_call={sum(within) / max(len(within), 1):.3g}", flush=True)


def say(line: str) -> None:
    print(line, flush=True)


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    await trainer_and_ps(rank, world, lambda: run_trainer(args))


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0], world=2)
    parser.add_argument("--out", help="folder for the traces (default: a new temporary one)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before profiling")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--all-threads", action="store_true", help="profile every thread")
    launch(worker, parser)


if __name__ == "__main__":
    main()
