"""A parameter server with distributed autograd: trainers train a ConvNet that lives on "ps".

This mirrors PyTorch's tutorial "Implementing a Parameter Server Using Distributed RPC
Framework", written the asyncio way on asyncrpc, with scikit-learn's 8x8 handwritten
digits instead of MNIST (no download).

* Rank 0 is the parameter server, ``ps``.  It holds a single :class:`ParameterServer`,
  an ``nn.Module`` wrapping a small ConvNet, made on first request by
  :func:`get_parameter_server`.
* Every other rank is a trainer.  Its :class:`TrainerNet` holds an RRef to that server
  (``asyncrpc.remote``) and runs the forward pass *on the server* through it.  For each
  batch of its own shard of the training split the trainer opens a distributed autograd
  context, computes the loss locally from the server's output, runs
  ``asyncrpc.autograd.backward`` (which reaches the server's parameters), and steps a
  ``DistributedOptimizer`` built over RRefs to the server's parameters.
* The server loads the digits (a fixed, stratified 80/20 train/test split) and hands
  each trainer its shard of the training split.  Trainers run concurrently, without
  waiting for one another (asynchronous SGD).  When all are done, the server reports the
  held-out accuracy of the model it holds.
* With several trainers, one trainer's optimizer step changes the weights in place
  while another's forward pass still waits for its backward; the tutorial's code then
  fails ("modified by an inplace operation", pytorch/examples#780).  Here forward
  passes and steps take turns on the server's weights under one lock, and autograd
  keeps its own copy of what it saves for the backward (see ``ParameterServer.forward``).

Run it::

    python examples/parameter_server.py                 # 1 server + 2 trainers on loopback
    python examples/parameter_server.py --world 4       # 1 server + 3 trainers
    torchrun --nproc-per-node 3 examples/parameter_server.py

It ends with ``RESULT accuracy=<held-out accuracy>`` (about 0.97 by default).
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import torch
from _digits import Net, Split, accuracy, digits_split
from _launch import base_parser, launch
from _progress import progress, say
from torch import nn
from torch.nn.functional import nll_loss

import asyncrpc
from asyncrpc.optim import DistributedOptimizer


def log(line: str) -> None:
    """Print a line in one write, so that lines from concurrent workers never mix."""
    say(line)


# --------- Parameter server (rank 0) --------------------


# The server's weights are read by trainers' forward passes and written by their
# optimizer steps, each in a thread of ps's pool: one lock keeps the two apart.
_weights_lock = threading.Lock()


def _keep_a_copy(saved: torch.Tensor) -> torch.Tensor:
    return saved.detach().clone()


def _as_is(saved: torch.Tensor) -> torch.Tensor:
    return saved


class LockedSGD(torch.optim.SGD):
    """SGD whose steps hold the server's weights lock (trainers name it in their
    ``DistributedOptimizer``; it is built and stepped on ``ps``)."""

    def step(self, closure: Any = None) -> Any:
        with _weights_lock:
            return super().step(closure)


class ParameterServer(nn.Module):
    """Holds the model; trainers call its methods through an RRef."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's forward pass, run here for a trainer (in ``ps``'s thread pool).

        Other trainers step the weights in place before this pass's backward runs, so
        autograd keeps copies of the tensors it saves (the gradients are then those of
        the weights this pass saw, as in any asynchronous SGD); otherwise it would find
        them modified and refuse to go back through them.
        """
        with _weights_lock, torch.autograd.graph.saved_tensors_hooks(_keep_a_copy, _as_is):
            out: torch.Tensor = self.model(x)
        return out

    def get_param_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        """RRefs to the model's parameters, for a trainer's ``DistributedOptimizer``."""
        return [asyncrpc.RRef(p) for p in self.model.parameters()]

    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Held-out accuracy of the model as it is now."""
        with _weights_lock:
            return accuracy(self.model, x, y)


_dataset: Split | None = None  # loaded by ps before it joins the job
_param_server: ParameterServer | None = None
_param_server_lock = threading.Lock()


def training_shard(index: int, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard ``index`` of ``shards`` of the training split (runs on ``ps``)."""
    assert _dataset is not None
    train_x, train_y, _, _ = _dataset
    return train_x[index::shards], train_y[index::shards]


def get_parameter_server() -> ParameterServer:
    """The one ParameterServer of the job, made on first call (runs on ``ps``)."""
    global _param_server
    with _param_server_lock:  # trainers' calls run in ps's thread pool, concurrently
        if _param_server is None:
            _param_server = ParameterServer()
        return _param_server


# --------- Trainers (ranks 1..) --------------------


class TrainerNet:
    """A trainer's handle on the server's model: forward runs on ``ps``."""

    def __init__(self) -> None:
        self.param_server_rref = asyncrpc.remote("ps", get_parameter_server)

    async def get_global_param_rrefs(self) -> list[asyncrpc.RRef[torch.Tensor]]:
        """RRefs to the server model's parameters (made on ``ps``)."""
        params: list[asyncrpc.RRef[torch.Tensor]]
        params = await self.param_server_rref.rpc_async().get_param_rrefs()
        return params

    async def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The server model's output for ``x``, recorded by distributed autograd."""
        out: torch.Tensor = await self.param_server_rref.rpc_async().forward(x)
        return out


async def run_training_loop(rank: int, world: int, args: argparse.Namespace) -> None:
    """Train the server's model on this trainer's shard of the training split."""
    epochs = args.epochs or (4 if args.smoke else 8)
    shard_x, shard_y = await asyncrpc.rpc_async("ps", training_shard, args=(rank - 1, world - 1))
    net = TrainerNet()
    opt = DistributedOptimizer(
        LockedSGD, await net.get_global_param_rrefs(), lr=args.lr, momentum=0.9
    )
    batches = -(-len(shard_y) // args.batch_size)
    log(f"[trainer{rank}] {len(shard_y)} training images, {epochs} epochs")
    show = rank == 1  # one bar for the job: the trainers go at about the same pace
    for epoch in progress(range(epochs), desc=f"[trainer{rank}] epochs", show=show):
        order = torch.randperm(len(shard_y))
        total = 0.0
        for batch in order.split(args.batch_size):
            async with asyncrpc.autograd.context() as ctx:
                output = await net.forward(shard_x[batch])
                loss = nll_loss(output, shard_y[batch])
                await asyncrpc.autograd.backward(ctx, [loss])
                await opt.step(ctx)
            total += loss.item()
        log(f"[trainer{rank}] epoch {epoch + 1}/{epochs}  mean loss {total / batches:.4f}")


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    if world < 2:
        raise SystemExit("need at least 2 workers: the server and one trainer")
    global _dataset
    name = "ps" if rank == 0 else f"trainer{rank}"
    if rank == 0:  # before joining: once in the job, ps's event loop must stay responsive
        _dataset = digits_split()
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    started = time.monotonic()
    if rank == 0:
        log(f"[ps] serving the model to {world - 1} trainers")
    else:
        await run_training_loop(rank, world, args)
    await asyncrpc.shutdown()  # waits for every worker: on ps, until training is over
    if rank == 0:
        assert _dataset is not None
        _, _, test_x, test_y = _dataset
        held_out = get_parameter_server().accuracy(test_x, test_y)
        log(
            f"[ps] training took {time.monotonic() - started:.1f} s; "
            f"held-out accuracy {held_out:.3f} on {len(test_y)} images"
        )
        log(f"RESULT accuracy={held_out:.4f}")


def make_parser() -> argparse.ArgumentParser:
    parser = base_parser(__doc__.splitlines()[0], world=3)
    parser.add_argument("--epochs", type=int, default=None, help="default 8; 4 with --smoke")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser


if __name__ == "__main__":
    launch(worker, make_parser())
