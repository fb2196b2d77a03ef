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

It ends with ``RESULT accuracy=<held-out accuracy>`` (about 0.97 by default).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from _digits import Net, accuracy, digits_split
from _launch import base_parser, launch
from asyncrpc.functions import async_execution
from torch.nn.functional import nll_loss

import asyncrpc

Weights = dict[str, torch.Tensor]


class BatchUpdateParameterServer:
    """Holds the model; applies one optimizer step per batch of pushed gradients."""

    def __init__(self, trainers: int, batch_update_size: int, lr: float) -> None:
        self.model = Net()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.batch_update_size = batch_update_size
        self.training = trainers  # trainers that have pushes left, or a push unanswered
        self.pending = 0  # pushes in the batch being gathered
        self.finishing = 0  # of those, trainers' last pushes
        self.pushes = 0
        self.updates = 0
        self.first_push = 0.0
        self.last_update = 0.0
        self.next_weights: asyncio.Future[Weights] = asyncio.get_running_loop().create_future()

    def weights(self) -> Weights:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @staticmethod
    def get_model(ps_rref: asyncrpc.RRef[BatchUpdateParameterServer]) -> Weights:
        return ps_rref.local_value().weights()

    @staticmethod
    @async_execution
    def update_and_fetch_model(
        ps_rref: asyncrpc.RRef[BatchUpdateParameterServer],
        grads: list[torch.Tensor],
        last: bool,
    ) -> asyncio.Future[Weights]:
        """Add one trainer's gradients; the reply waits for the batch's update."""
        return ps_rref.local_value().push(grads, last)

    def push(self, grads: list[torch.Tensor], last: bool) -> asyncio.Future[Weights]:
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


async def run_trainer(
    ps_rref: asyncrpc.RRef[BatchUpdateParameterServer],
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    batch_size: int,
) -> None:
    """A trainer (runs on its own worker): ``steps`` pushes of mini-batch gradients."""
    name = asyncrpc.get_worker_info().name
    ps = ps_rref.owner()
    model = Net()
    model.load_state_dict(await asyncrpc.rpc_async(ps, BatchUpdateParameterServer.get_model, (ps_rref,)))
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
        if (step + 1) % 50 == 0 or last:
            recent = losses[-50:]
            print(f"[{name}] step {step + 1}/{steps}  loss {sum(recent) / len(recent):.4f}", flush=True)


def mini_batches(samples: int, batch_size: int):
    """Index batches over reshuffled epochs, forever."""
    while True:
        yield from torch.randperm(samples).split(batch_size)
