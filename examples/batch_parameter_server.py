"""A batch-updating parameter server: one optimizer step per N gradient pushes.

This mirrors the parameter server of PyTorch's tutorial "Implementing Batch RPC
Processing Using Asynchronous Executions", written the asyncio way on asyncrpc, on
scikit-learn's 8x8 handwritten digits.

* Rank 0, ``ps``, loads the digits (a fixed, stratified 80/20 train/test split), makes a
  :class:`BatchUpdateParameterServer` owned through an ``RRef``, and starts every trainer
  with ``rpc_async(trainer, run_trainer, (ps_rref, its shard, ...))``.
* Each trainer keeps its own copy of the ConvNet.  Per step it computes the gradients
  of a mini-batch of its shard locally and pushes them with
  ``rpc_async(ps, BatchUpdateParameterServer.update_and_fetch_model, (ps_rref, grads))``.
* That handler is an ``@asyncrpc.functions.async_execution`` function: it runs on the
  server's event loop, adds the gradients up and returns an asyncio future that no
  thread waits on.  Once N pushes have arrived (N = ``--batch-update-size``, the number
  of trainers by default) the server averages them, takes ONE optimizer step, and
  resolves the future: every waiting trainer gets the new weights in its reply.
  Everything runs on one event loop, so the server needs no lock.
* The server reports progress, its update rate, and the final held-out accuracy.

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
from collections.abc import Iterator

import torch
from _digits import Net, Split, accuracy, digits_split
from _launch import base_parser, launch
from torch import Tensor
from torch.nn.functional import nll_loss

import asyncrpc
from asyncrpc.functions import async_execution

Weights = dict[str, Tensor]
REPORT_EVERY = 50  # steps between progress lines


class BatchUpdateParameterServer:
    """Holds the model; applies one optimizer step per batch of pushed gradients."""

    def __init__(
        self, trainers: int, batch_update_size: int, lr: float, test_set: tuple[Tensor, Tensor]
    ) -> None:
        self.model = Net()
        self.test_set = test_set
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.batch_update_size = batch_update_size
        self.training = trainers  # trainers that have pushes left, or a push unanswered
        self.pending = 0  # pushes in the batch being gathered
        self.finishing = 0  # of those, trainers' last pushes
        self.pushes = 0
        self.updates = 0
        self.first_push = 0.0
        self.last_update = 0.0
        self.next_weights: asyncio.Future[Weights] = asyncio.get_running_loop().create_future()

    def accuracy(self) -> float:
        return accuracy(self.model, *self.test_set)

    def weights(self) -> Weights:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @staticmethod
    def get_model(ps_rref: asyncrpc.RRef[BatchUpdateParameterServer]) -> Weights:
        return ps_rref.local_value().weights()

    @staticmethod
    @async_execution
    def update_and_fetch_model(
        ps_rref: asyncrpc.RRef[BatchUpdateParameterServer],
        grads: list[Tensor],
        last: bool,
    ) -> asyncio.Future[Weights]:
        """Add one trainer's gradients; the reply waits for the batch's update."""
        return ps_rref.local_value().push(grads, last)

    def push(self, grads: list[Tensor], last: bool) -> asyncio.Future[Weights]:
        if self.pushes == 0:
            self.first_push = time.monotonic()
        for param, grad in zip(self.model.parameters(), grads, strict=True):
            param.grad = grad if param.grad is None else param.grad + grad
        self.pushes += 1
        self.pending += 1
        self.finishing += last
        answer = self.next_weights
        # Update once the batch is full, or when every trainer still training is waiting
        # here (with N < trainers the last pushes may not fill a batch).
        if self.pending in (self.batch_update_size, self.training):
            self.update()
        return answer

    def update(self) -> None:
        """One optimizer step with the mean of the batch's gradients; answer the batch."""
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad /= self.pending
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.updates += 1
        self.last_update = time.monotonic()
        self.training -= self.finishing
        self.pending = self.finishing = 0
        self.next_weights.set_result(self.weights())
        self.next_weights = asyncio.get_running_loop().create_future()
        if self.updates % REPORT_EVERY == 0:
            log(f"[ps] update {self.updates}: held-out accuracy {self.accuracy():.3f}")


async def run_trainer(
    ps_rref: asyncrpc.RRef[BatchUpdateParameterServer],
    x: Tensor,
    y: Tensor,
    steps: int,
    batch_size: int,
) -> None:
    """A trainer (runs on its own worker): ``steps`` pushes of mini-batch gradients."""
    name = asyncrpc.get_worker_info().name
    ps = ps_rref.owner()
    model = Net()
    model.load_state_dict(
        await asyncrpc.rpc_async(ps, BatchUpdateParameterServer.get_model, (ps_rref,))
    )
    batches = mini_batches(len(y), batch_size)
    losses: list[float] = []
    for step in range(steps):
        batch = next(batches)
        loss = nll_loss(model(x[batch]), y[batch])
        model.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        last = step == steps - 1
        weights = await asyncrpc.rpc_async(
            ps, BatchUpdateParameterServer.update_and_fetch_model, (ps_rref, grads, last)
        )
        model.load_state_dict(weights)
        losses.append(loss.item())
        if (step + 1) % REPORT_EVERY == 0 or last:
            recent = losses[-REPORT_EVERY:]
            log(f"[{name}] step {step + 1}/{steps}  loss {sum(recent) / len(recent):.4f}")


def log(line: str) -> None:
    """Print a line in one write, so that lines from concurrent workers never mix."""
    print(line + "\n", end="", flush=True)


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
    server = BatchUpdateParameterServer(trainers, batch_update_size, args.lr, (test_x, test_y))
    ps_rref = asyncrpc.RRef(server)
    log(f"[ps] {trainers} trainers x {steps} pushes; one update per {batch_update_size} pushes")
    await asyncio.gather(
        *(
            asyncrpc.rpc_async(
                f"trainer{i + 1}",
                run_trainer,
                (ps_rref, train_x[i::trainers], train_y[i::trainers], steps, args.batch_size),
                timeout=0,  # training takes as long as it takes
            )
            for i in range(trainers)
        )
    )
    elapsed = server.last_update - server.first_push
    log(
        f"server: {server.updates} updates in {elapsed:.1f} s, "
        f"{server.updates / elapsed:.1f} updates/s ({server.pushes} pushes)"
    )
    held_out = server.accuracy()
    log(f"[ps] held-out accuracy {held_out:.3f} on {len(test_y)} images")
    log(f"RESULT accuracy={held_out:.4f}")


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
    return parser


if __name__ == "__main__":
    launch(worker, make_parser())
