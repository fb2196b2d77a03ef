"""An asynchronous parameter server: 1 server, 2 trainers, batched updates.

The server holds the model.  Each trainer pulls the weights, computes
gradients on its own shard of the data, and pushes them with
``update_and_fetch``, an ``@async_execution`` handler: pushes wait (holding no
thread) until one has arrived from every trainer, then the server averages
them, takes one optimizer step, and answers every waiting trainer with the new
weights.  This is the batch-processing pattern of PyTorch's RPC tutorials,
written the asyncio way.

    python examples/parameter_server.py            # spawns its 3 workers on loopback
    torchrun --nproc-per-node 3 examples/parameter_server.py   # or under torchrun

The task: a student MLP learns to imitate a fixed random "teacher" network on
10-way classification, so the data needs no download.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import torch
from torch import nn

import asyncrpc
from asyncrpc.functions import async_execution

FEATURES, CLASSES = 32, 10


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def make_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the labels a fixed teacher network gives them."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(FEATURES, 48, generator=teacher)
    w2 = torch.randn(48, CLASSES, generator=teacher)
    x = torch.randn(samples, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)


class ParameterServer:
    """Lives on the server worker; trainers reach it through static RPC handlers."""

    instance: ParameterServer | None = None

    def __init__(self, trainers: int, lr: float) -> None:
        self.model = make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.trainers = trainers
        self.pushes = 0
        self.updates = 0
        self.next_weights: asyncio.Future[list[torch.Tensor]] | None = None

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    @staticmethod
    def get_weights() -> list[torch.Tensor]:
        assert ParameterServer.instance is not None
        return ParameterServer.instance.weights()

    @staticmethod
    @async_execution
    def update_and_fetch(grads: list[torch.Tensor]) -> asyncio.Future[list[torch.Tensor]]:
        """Accumulate one trainer's gradients; answer all once every trainer has pushed."""
        ps = ParameterServer.instance
        assert ps is not None
        if ps.next_weights is None:
            ps.next_weights = asyncio.get_running_loop().create_future()
            for param in ps.model.parameters():
                param.grad = torch.zeros_like(param)
        for param, grad in zip(ps.model.parameters(), grads, strict=True):
            param.grad += grad / ps.trainers  # type: ignore[operator]
        ps.pushes += 1
        answer = ps.next_weights
        if ps.pushes % ps.trainers == 0:
            ps.optimizer.step()
            ps.updates += 1
            answer.set_result(ps.weights())
            ps.next_weights = None
        return answer


async def train(rank: int, world: int, steps: int) -> float:
    x, y = make_data(4096, seed=rank)
    model = make_model()
    weights = await asyncrpc.rpc_async("ps", ParameterServer.get_weights)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        with torch.no_grad():
            for param, w in zip(model.parameters(), weights, strict=True):
                param.copy_(w)
        batch = torch.randint(0, len(x), (128,))
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        model.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        weights = await asyncrpc.rpc_async("ps", ParameterServer.update_and_fetch, args=(grads,))
        if step % 50 == 0 or step == steps - 1:
            print(f"[trainer{rank}] step {step:4d}  loss {loss.item():.4f}", flush=True)
    return float(loss.item())


def evaluate() -> tuple[float, float]:
    ps = ParameterServer.instance
    assert ps is not None
    x, y = make_data(2048, seed=999)
    with torch.no_grad():
        logits = ps.model(x)
    return (
        nn.functional.cross_entropy(logits, y).item(),
        (logits.argmax(dim=1) == y).float().mean().item(),
    )


async def worker(rank: int, world: int, steps: int) -> None:
    name = "ps" if rank == 0 else f"trainer{rank}"
    if rank == 0:
        ParameterServer.instance = ParameterServer(trainers=world - 1, lr=0.05)
        loss, accuracy = evaluate()
        print(
            f"[ps] before training: held-out loss {loss:.4f}, accuracy {accuracy:.1%}", flush=True
        )
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    started = time.monotonic()
    if rank > 0:
        await train(rank, world, steps)
    await asyncrpc.shutdown()
    if rank == 0:
        assert ParameterServer.instance is not None
        loss, accuracy = evaluate()
        print(
            f"[ps] {ParameterServer.instance.updates} updates in "
            f"{time.monotonic() - started:.1f}s; held-out loss {loss:.4f}, "
            f"accuracy {accuracy:.1%}",
            flush=True,
        )
        print(f"RESULT final_loss={loss:.4f}", flush=True)


def spawn(world: int, steps: int) -> int:
    """Start every worker as a subprocess on loopback (what torchrun would do)."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--steps", str(steps)], env={**env, "RANK": str(r)}
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(codes, key=abs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit(spawn(args.trainers + 1, args.steps))
    import uvloop

    torch.manual_seed(int(os.environ["RANK"]))
    torch.set_num_threads(1)
    uvloop.run(worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.steps))


if __name__ == "__main__":
    main()
