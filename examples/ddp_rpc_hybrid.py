"""DistributedDataParallel combined with RPC: a sparse part on a server, a dense part replicated.

This mirrors PyTorch's *Combining Distributed DataParallel with Distributed RPC
Framework* tutorial, written the asyncio way on asyncrpc.  Four workers:

* ``trainer0`` and ``trainer1`` (ranks 0 and 1) each hold an ``nn.Linear`` wrapped in
  ``DistributedDataParallel`` over a gloo process group of the two trainers only (its
  own rendezvous, on ``MASTER_PORT + 1``, apart from asyncrpc's);
* ``master`` (rank 2) creates an ``nn.EmbeddingBag`` on the parameter server as an
  ``asyncrpc.nn.RemoteModule`` and drives the training loop on both trainers with
  ``rpc_async(trainer, run_trainer, ...)``;
* ``ps`` (rank 3) holds the embedding table and answers everyone's RPCs.

Each trainer step runs in a distributed autograd context: the embedding lookup on
``ps`` through the RemoteModule, the DDP Linear locally, ``await
asyncrpc.autograd.backward(ctx, [loss])`` (which reaches ``ps``), then a step of the
trainer's ``DistributedOptimizer`` over the embedding's parameter RRefs (from
``remote_parameters()``) and its Linear's (``asyncrpc.RRef(p)``): each owner updates
its own, and ``ps`` serialises the two trainers' steps on the shared table.

DDP and asyncrpc: as in torch, the DDP Linear's gradients are averaged over the
trainers' group by the distributed backward itself (asyncrpc runs a DDP forward inside
a context as under ``no_sync()`` and all-reduces its parameters' gradients in the
context when the backward is done; see docs/autograd.md), and the example checks that
the two trainers' Linear weights stay identical.

The task is synthetic but learnable: a bag of random indices is labelled with the
class a fixed "teacher" table scores highest for the bag (summed over its indices),
which the EmbeddingBag (sum) plus Linear can represent exactly.  Prints the loss per
epoch and ``RESULT loss_ratio=`` (the last epoch's mean loss over the first's).

    python examples/ddp_rpc_hybrid.py              # spawns its 4 workers on loopback
    python examples/ddp_rpc_hybrid.py --smoke      # a short run for the tests
    torchrun --nproc-per-node 4 examples/ddp_rpc_hybrid.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _launch import base_parser, launch
from _progress import progress, say
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import asyncrpc
from asyncrpc.autograd import backward, context
from asyncrpc.nn import RemoteModule
from asyncrpc.optim import DistributedOptimizer

NUM_EMBEDDINGS, EMBEDDING_DIM, CLASSES = 100, 16, 8
LR = 0.03
TRAINERS = 2


class HybridModel(nn.Module):
    """Sparse part: an EmbeddingBag on ``ps`` (RemoteModule); dense part: a DDP Linear."""

    def __init__(self, remote_emb_module: RemoteModule) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DistributedDataParallel(nn.Linear(EMBEDDING_DIM, CLASSES))

    async def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = await self.remote_emb_module.forward_async(indices, offsets)
        return self.fc(emb_lookup)


# -- data ------------------------------------------------------------------------------


def teacher() -> torch.Tensor:
    """The fixed table that defines the labels (the same on every trainer)."""
    return torch.randn(NUM_EMBEDDINGS, CLASSES, generator=torch.Generator().manual_seed(42))


def make_batch(
    gen: torch.Generator, bags: int, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``bags`` bags of 2 to 10 random indices; each labelled by the teacher's top class."""
    lengths = torch.randint(2, 11, (bags,), generator=gen)
    indices = torch.randint(0, NUM_EMBEDDINGS, (int(lengths.sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    summed = nn.functional.embedding_bag(indices, scores, offsets, mode="sum")
    return indices, offsets, summed.argmax(dim=1)


# -- the trainers -------------------------------------------------------------------------


async def train_step(
    model: HybridModel,
    opt: DistributedOptimizer,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> float:
    indices, offsets, target = batch
    async with context() as ctx:
        output = await model(indices, offsets)
        loss = nn.functional.cross_entropy(output, target)
        await backward(ctx, [loss])  # (the DDP Linear's gradients: averaged over trainers)
        await opt.step(ctx)
    return loss.item()


def weights_disagreement(model: HybridModel) -> float:
    """Largest difference between the trainers' Linear parameters (0.0: identical)."""
    mine = torch.nn.utils.parameters_to_vector(model.fc.parameters()).detach()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return max(float((other - mine).abs().max()) for other in everyone)


@dataclass(frozen=True)
class Schedule:
    epochs: int
    batches: int  # per epoch
    bags: int  # per batch


async def run_trainer(
    remote_emb_module: RemoteModule, rank: int, plan: Schedule
) -> tuple[list[float], float]:
    """Train on this trainer's data; returns the mean loss per epoch and the final
    largest difference between the trainers' Linear weights."""
    # DDP's constructor broadcasts the Linear from trainer0, a blocking collective:
    # build it off the event loop, which must keep answering the other workers.
    model = await asyncio.to_thread(HybridModel, remote_emb_module)
    # The table's parameters (RRefs from ps) and the local Linear's (wrapped here); not
    # model.parameters(), which would not reach into the RemoteModule.
    params = await model.remote_emb_module.remote_parameters()
    params += [asyncrpc.RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=LR)
    gen = torch.Generator().manual_seed(1000 + rank)
    scores = teacher()
    epoch_losses = []
    show = rank == 0  # one bar for the job: DDP keeps the trainers in step
    for epoch in progress(range(plan.epochs), desc=f"[trainer{rank}] epochs", show=show):
        losses = [
            await train_step(model, opt, make_batch(gen, plan.bags, scores))
            for _ in range(plan.batches)
        ]
        epoch_losses.append(sum(losses) / len(losses))
        gap = await asyncio.to_thread(weights_disagreement, model)
        say(
            f"[trainer{rank}] epoch {epoch:3d}  loss {epoch_losses[-1]:.4f}  "
            f"Linear weights differ from the other trainer's by {gap:.2e}"
        )
    return epoch_losses, gap


# -- the master --------------------------------------------------------------------------


async def run_master(args: argparse.Namespace) -> None:
    remote_emb_module = RemoteModule(
        "ps/cpu", nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"}
    )
    plan = Schedule(args.epochs or (5 if args.smoke else 20), args.batches, args.bags)
    started = time.monotonic()
    futs = [
        asyncrpc.rpc_async(
            f"trainer{rank}",
            run_trainer,
            args=(remote_emb_module, rank, plan),
            timeout=0,
        )
        for rank in range(TRAINERS)
    ]
    results = await asyncio.gather(*futs)
    initial = sum(losses[0] for losses, _ in results) / TRAINERS
    final = sum(losses[-1] for losses, _ in results) / TRAINERS
    gap = max(gap for _, gap in results)
    print(
        f"[master] {plan.epochs} epochs in {time.monotonic() - started:.1f}s; mean loss "
        f"{initial:.4f} -> {final:.4f}; trainers' Linear weights identical: {gap == 0.0}",
        flush=True,
    )
    if gap != 0.0:
        raise AssertionError(f"the trainers' Linear weights diverged by {gap}")
    print(f"RESULT loss_ratio={final / initial:.4f}", flush=True)


def init_ddp_group(rank: int) -> None:
    """DDP's gloo process group: the trainers only, through a store of their own on
    ``MASTER_PORT + 1`` (asyncrpc rendezvouses on ``MASTER_PORT``).  The store is made
    explicitly: under torchrun, ``init_method="tcp://..."`` would expect torchrun's
    agent to host it."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
    store = dist.TCPStore(host, port, world_size=TRAINERS, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=TRAINERS)


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    if world != TRAINERS + 2:
        raise SystemExit(f"this example runs {TRAINERS + 2} workers, not {world}")
    if rank < TRAINERS:
        init_ddp_group(rank)
    name = {TRAINERS: "master", TRAINERS + 1: "ps"}.get(rank, f"trainer{rank}")
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    if name == "master":
        await run_master(args)
    await asyncrpc.shutdown()
    if rank < TRAINERS:
        dist.destroy_process_group()


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0], world=TRAINERS + 2)
    parser.add_argument("--epochs", type=int, help="default: 20, or 5 with --smoke")
    parser.add_argument("--batches", type=int, default=20, help="batches per epoch")
    parser.add_argument("--bags", type=int, default=32, help="bags per batch")
    launch(worker, parser)


if __name__ == "__main__":
    main()
