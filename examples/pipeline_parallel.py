"""Pipeline parallelism over RPC: a model in two shards on two workers, fed micro-batches.

This mirrors PyTorch's *Distributed Pipeline Parallelism Using RPC* tutorial (a ResNet50
split over two GPUs there), written the asyncio way on asyncrpc.  Three workers: the
``master`` holds the data and drives training; ``worker1`` holds the first shard of an
MLP and ``worker2`` the second, each built with ``asyncrpc.remote``.

Each batch is split into micro-batches.  For each one the master calls
``shard1.remote().forward(x)``, which leaves the first shard's output on ``worker1``
and returns its RRef at once, and passes that RRef to ``shard2.rpc_async().forward``;
the second shard fetches the activations itself (``await rref.to_here()``, straight
from ``worker1``) and returns its output.  All micro-batches are in flight at once, so
``worker1`` computes micro-batch *i + 1* while ``worker2`` computes micro-batch *i*.
The master concatenates the outputs, computes the loss, and runs one distributed
backward pass and one ``DistributedOptimizer`` step per batch.

The task is ``sklearn``'s handwritten digits (8x8 images, 10 classes; no download).
Training alternates between 1, 2 and 4 micro-batches per batch, so the three step
times are measured in the same run under the same conditions.  Prints the loss as it
trains, the median forward and step times for each split, the test accuracy, and
``RESULT loss_ratio=`` (the mean loss of the last round of steps over the first's).

What splitting buys depends on the machine.  Only the forward pass is pipelined (the
backward pass crosses the shards once, in reverse), each micro-batch costs a few more
messages, and the overlap needs a free core for each shard: with the master, three
processes on a 2-core machine that other jobs share, expect no gain or a loss.  The
gain, where there is one, comes from the two shards computing at the same time.

    python examples/pipeline_parallel.py              # spawns its 3 workers on loopback
    python examples/pipeline_parallel.py --smoke      # a short run for the tests
    torchrun --nproc-per-node 3 examples/pipeline_parallel.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
from _launch import base_parser, launch
from _progress import progress, say
from torch import nn

import asyncrpc
from asyncrpc.autograd import backward, context
from asyncrpc.optim import DistributedOptimizer

SPLITS = (1, 2, 4)
FEATURES, CLASSES = 64, 10


# -- the two shards ----------------------------------------------------------------------


class Shard(nn.Module):
    """One part of the model, on its own worker; one micro-batch computes at a time."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.seq = nn.Sequential(*layers)
        self._lock = threading.Lock()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        with self._lock:
            return self.seq(x)

    async def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        return [asyncrpc.RRef(p) for p in self.parameters()]


class Shard1(Shard):
    """Input layers: called with the micro-batch itself (runs in the worker's threads)."""

    def __init__(self, hidden: int) -> None:
        super().__init__(
            [nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


class Shard2(Shard):
    """Output layers: called with an RRef of the first shard's output, which it fetches."""

    def __init__(self, hidden: int) -> None:
        super().__init__([nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)])

    async def forward(self, x_rref: asyncrpc.RRef[torch.Tensor]) -> torch.Tensor:
        x = await x_rref.to_here()
        return await asyncio.to_thread(self.run, x)  # compute off the event loop


class DistributedMLP:
    """The master's view of the model: two shards, fed micro-batches."""

    def __init__(self, hidden: int) -> None:
        self.shard1 = asyncrpc.remote("worker1", Shard1, args=(hidden,))
        self.shard2 = asyncrpc.remote("worker2", Shard2, args=(hidden,))

    async def forward(self, xs: torch.Tensor, splits: int) -> torch.Tensor:
        outputs = []
        for x in xs.chunk(splits):
            y_rref = self.shard1.remote().forward(x)  # returns at once
            outputs.append(self.shard2.rpc_async().forward(y_rref))
        return torch.cat(await asyncio.gather(*outputs))

    async def parameter_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        first, second = await asyncio.gather(
            self.shard1.rpc_async().parameter_rrefs(), self.shard2.rpc_async().parameter_rrefs()
        )
        return [*first, *second]


# -- training on the master -----------------------------------------------------------------


Data = tuple[torch.Tensor, torch.Tensor]


def load_data() -> tuple[Data, Data]:
    """Standardised digits, split into a training and a test set."""
    from sklearn.datasets import load_digits  # only the master needs it: import it here

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:300], order[300:]
    return (x[train], y[train]), (x[test], y[test])


@dataclass
class Timings:
    """Seconds per step, and per forward pass (the pipelined part), by split."""

    step: dict[int, list[float]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    forward: dict[int, list[float]] = field(default_factory=lambda: {s: [] for s in SPLITS})

    def report(self) -> None:
        print(
            f"[master] median time per batch of {len(self.step[1])} timed steps each "
            "(forward pass, whole step):",
            flush=True,
        )
        base = statistics.median(self.step[1])
        for splits in SPLITS:
            forward, step = (statistics.median(t[splits]) for t in (self.forward, self.step))
            print(
                f"[master]   {splits} split{'s' if splits > 1 else ' '}: forward "
                f"{forward * 1e3:6.1f} ms, step {step * 1e3:6.1f} ms "
                f"({base / step:.2f}x the speed of 1 split)",
                flush=True,
            )


async def train_step(
    model: DistributedMLP, opt: DistributedOptimizer, batch: Data, splits: int
) -> tuple[float, float, float]:
    """One step; returns the loss, the forward pass's seconds and the step's."""
    x, y = batch
    started = time.perf_counter()
    async with context() as ctx:
        output = await model.forward(x, splits)
        forward = time.perf_counter() - started
        loss = nn.functional.cross_entropy(output, y)
        await backward(ctx, [loss])
        await opt.step(ctx)
    return loss.item(), forward, time.perf_counter() - started


async def accuracy(model: DistributedMLP, data: Data) -> float:
    x, y = data
    logits = await model.forward(x, 4)
    return float((logits.argmax(dim=1) == y).float().mean())


async def run_master(args: argparse.Namespace) -> None:
    train, test = load_data()
    model = DistributedMLP(args.hidden)
    opt = DistributedOptimizer(torch.optim.Adam, await model.parameter_rrefs(), lr=args.lr)
    rounds = args.rounds or (8 if args.smoke else 40)
    timings = Timings()
    round_losses = []
    gen = torch.Generator().manual_seed(args.seed)
    for r in progress(range(rounds), desc="[master] rounds"):
        losses = []
        for splits in SPLITS:  # one step of each split per round: timed alike
            batch = torch.randint(0, len(train[0]), (args.batch,), generator=gen)
            loss, forward, step = await train_step(
                model, opt, (train[0][batch], train[1][batch]), splits
            )
            losses.append(loss)
            if r > 0:  # the first round pays one-off costs (imports, allocations)
                timings.forward[splits].append(forward)
                timings.step[splits].append(step)
        round_losses.append(sum(losses) / len(losses))
        if r % args.log_every == 0 or r == rounds - 1:
            say(f"[master] round {r:3d}  loss {round_losses[-1]:.4f}")
    timings.report()
    print(f"[master] test accuracy {await accuracy(model, test):.1%}", flush=True)
    print(f"RESULT loss_ratio={round_losses[-1] / round_losses[0]:.4g}", flush=True)


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    if world != 3:
        raise SystemExit(f"this example runs 3 workers, not {world}")
    name = "master" if rank == 0 else f"worker{rank}"
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    if rank == 0:
        await run_master(args)
    await asyncrpc.shutdown()


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0], world=3)
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds of 3 steps (1, 2, 4 splits); default: 40, or 8 with --smoke",
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=5)
    launch(worker, parser)


if __name__ == "__main__":
    main()
