"""A batch-updating parameter server: one optimizer step per N gradient pushes, with ``@batch``.

This is the parameter server of PyTorch's tutorial "Implementing Batch RPC Processing
Using Asynchronous Executions", written the asyncio way on asyncrpc, on scikit-learn's
8x8 handwritten digits.  The tutorial gathers the pushes by hand (a lock, a future per
batch, ``@async_execution``); here ``@asyncrpc.functions.batch`` does it.

* Rank 0, ``ps``, loads the digits (a fixed, stratified 80/20 train/test split), holds the
  model in a :class:`BatchUpdateParameterServer` and starts every trainer with
  ``rpc_async(trainer, run_trainer, (its shard, ...))``.
* Each trainer keeps its own copy of the ConvNet.  Per step it computes the gradients
  of a mini-batch of its shard locally and pushes them, one item, with
  ``rpc_async("ps", update_and_fetch_model, (grads,))``.
* ``update_and_fetch_model`` is a module-level function of a *list* of pushes, served
  with ``@batch``, whose limits the server sets at start-up from the command line
  (``update_and_fetch_model.configure(max_size=N, max_wait=--max-wait)``; N =
  ``--batch-update-size``, the number of trainers by default).  Once N pushes wait, it
  averages their gradients, takes ONE optimizer step and returns the new weights to each
  of the N trainers.  It is a plain function, so it runs in the server's thread pool,
  off the event loop, one batch at a time: no lock.
* When a trainer is done (its ``run_trainer`` returns), the server lowers ``max_size`` to
  the trainers still pushing if they are fewer than N: with N < trainers, the last
  trainer's pushes go at once, alone, rather than each waiting ``--max-wait`` for a
  partner that will not come.  ``--max-wait`` is left for a push whose partners are
  late.
* A batched function travels by name, so it reaches the server's model through a class
  attribute, ``BatchUpdateParameterServer.serving``.
* The server reports progress, its update rate, the batch sizes formed
  (``update_and_fetch_model.stats()``: ``batch sizes formed: {size: batches}`` and
  ``RESULT mean_batch_size=<pushes / updates>``) and the final held-out accuracy.

Run it::

    python examples/batch_parameter_server.py               # 1 server + 2 trainers
    python examples/batch_parameter_server.py --world 4 --batch-update-size 2
    torchrun --nproc-per-node 3 examples/batch_parameter_server.py

It ends with ``RESULT accuracy=<held-out accuracy>`` (about 0.98 by default).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Iterator
from typing import ClassVar

import torch
from _digits import Net, Split, accuracy, digits_split
from _launch import base_parser, launch
from _progress import progress, say
from torch import Tensor
from torch.nn.functional import nll_loss

import asyncrpc
from asyncrpc.functions import batch

Weights = dict[str, Tensor]
REPORT_EVERY = 50  # steps between progress lines


class BatchUpdateParameterServer:
    """Holds the model on ``ps``; applies one optimizer step per batch of pushed gradients."""

    serving: ClassVar[BatchUpdateParameterServer | None] = None  # on ps: the functions' state

    def __init__(self, lr: float, test_set: tuple[Tensor, Tensor]) -> None:
        self.model = Net()
        self.test_set = test_set
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.updates = 0
        self.first_update = 0.0
        self.last_update = 0.0
        BatchUpdateParameterServer.serving = self

    def accuracy(self) -> float:
        return accuracy(self.model, *self.test_set)

    def weights(self) -> Weights:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def update(self, pushes: list[list[Tensor]]) -> Weights:
        """One optimizer step with the mean of the pushes' gradients; the new weights."""
        if self.updates == 0:
            self.first_update = time.monotonic()
        for param, grads in zip(self.model.parameters(), zip(*pushes, strict=True), strict=True):
            param.grad = torch.stack(grads).mean(dim=0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.updates += 1
        self.last_update = time.monotonic()
        if self.updates % REPORT_EVERY == 0:
            log(f"[ps] update {self.updates}: held-out accuracy {self.accuracy():.3f}")
        return self.weights()


def the_server() -> BatchUpdateParameterServer:
    """The server this worker holds (the functions below run on ps)."""
    server = BatchUpdateParameterServer.serving
    assert server is not None, "the parameter server lives on ps"
    return server


def get_model() -> Weights:
    """The server's current weights (a trainer's first call)."""
    return the_server().weights()


@batch  # its limits come from the command line: the server configures them (run_server)
def update_and_fetch_model(pushes: list[list[Tensor]]) -> list[Weights]:
    """The server's batched update: each push, a trainer's gradients, gets the new weights."""
    weights = the_server().update(pushes)
    return [weights] * len(pushes)


async def run_trainer(x: Tensor, y: Tensor, steps: int, batch_size: int) -> None:
    """A trainer (runs on its own worker): ``steps`` pushes of mini-batch gradients."""
    name = asyncrpc.get_worker_info().name
    model = Net()
    model.load_state_dict(await asyncrpc.rpc_async("ps", get_model))
    batches = mini_batches(len(y), batch_size)
    losses: list[float] = []
    show = name == "trainer1"  # one bar for the job: the trainers step together
    for step in progress(range(1, steps + 1), desc=f"[{name}] pushes", show=show):
        rows = next(batches)
        loss = nll_loss(model(x[rows]), y[rows])
        model.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        model.load_state_dict(await asyncrpc.rpc_async("ps", update_and_fetch_model, (grads,)))
        losses.append(loss.item())
        if step % REPORT_EVERY == 0 or step == steps:
            recent = losses[-REPORT_EVERY:]
            log(f"[{name}] step {step}/{steps}  loss {sum(recent) / len(recent):.4f}")


class Pushing:
    """The trainers still pushing, and the batch size they can still fill."""

    def __init__(self, trainers: int, batch_update_size: int) -> None:
        self.trainers = trainers
        self.batch_update_size = batch_update_size

    async def until_done(self, trainer: Awaitable[None]) -> None:
        """Wait for one trainer's run; then no batch waits for more pushes than are left."""
        try:
            await trainer
        finally:
            self.trainers -= 1
        if 0 < self.trainers < self.batch_update_size:
            update_and_fetch_model.configure(max_size=self.trainers)


def log(line: str) -> None:
    """Print a line in one write, so that lines from concurrent workers never mix."""
    say(line)


def mini_batches(samples: int, batch_size: int) -> Iterator[Tensor]:
    """Index batches over reshuffled epochs, forever."""
    while True:
        yield from torch.randperm(samples).split(batch_size)


async def run_server(
    trainers: int, batch_update_size: int, data: Split, args: argparse.Namespace
) -> None:
    """Rank 0: start every trainer on its shard, wait for them, report."""
    train_x, train_y, test_x, test_y = data
    shard = len(train_y) // trainers
    steps = (args.epochs or (6 if args.smoke else 15)) * -(-shard // args.batch_size)
    server = BatchUpdateParameterServer(args.lr, (test_x, test_y))
    update_and_fetch_model.configure(max_size=batch_update_size, max_wait=args.max_wait)
    log(f"[ps] {trainers} trainers x {steps} pushes; one update per {batch_update_size} pushes")
    pushing = Pushing(trainers, batch_update_size)
    await asyncio.gather(
        *(
            pushing.until_done(
                asyncrpc.rpc_async(
                    f"trainer{i + 1}",
                    run_trainer,
                    (train_x[i::trainers], train_y[i::trainers], steps, args.batch_size),
                    timeout=0,  # training takes as long as it takes
                )
            )
            for i in range(trainers)
        )
    )
    stats = update_and_fetch_model.stats()
    elapsed = server.last_update - server.first_update
    log(
        f"server: {stats['batches']} updates in {elapsed:.1f} s, "
        f"{stats['batches'] / elapsed:.1f} updates/s ({stats['items']} pushes)"
    )
    log(f"batch sizes formed: {stats['sizes']}")
    held_out = server.accuracy()
    log(f"[ps] held-out accuracy {held_out:.3f} on {len(test_y)} images")
    log(f"RESULT accuracy={held_out:.4f}")
    log(f"RESULT mean_batch_size={stats['items'] / stats['batches']:.2f}")


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    if world < 2:
        raise SystemExit("need at least 2 workers: the server and one trainer")
    trainers = world - 1
    batch_update_size = args.batch_update_size or trainers
    if not 1 <= batch_update_size <= trainers:
        raise SystemExit(f"--batch-update-size must be between 1 and {trainers} (trainers)")
    # ps loads the data before joining: once in the job, its event loop must stay free
    # to answer peers (a loop blocked for seconds cannot even accept a connection).
    data = digits_split() if rank == 0 else None
    name = "ps" if rank == 0 else f"trainer{rank}"
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    if data is not None:
        await run_server(trainers, batch_update_size, data, args)
    # Trainers just serve: ps calls run_trainer on them.  shutdown() waits for every
    # other worker to call it too, so a trainer stays up until ps is done with it.
    await asyncrpc.shutdown()


def make_parser() -> argparse.ArgumentParser:
    parser = base_parser(__doc__.splitlines()[0], world=3)
    parser.add_argument(
        "--batch-update-size",
        type=int,
        default=None,
        help="pushes per optimizer step (default: the number of trainers)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="default 15; 6 with --smoke")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.005, help="Adam learning rate")
    parser.add_argument(
        "--max-wait",
        type=float,
        default=1.0,
        help="seconds a push waits for the rest of its batch before a smaller batch goes",
    )
    return parser


if __name__ == "__main__":
    launch(worker, make_parser())
