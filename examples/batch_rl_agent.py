"""REINFORCE on CartPole with a batching agent: one policy forward per step for all observers.

The batched agent of PyTorch's RPC tutorials ("Implementing batch RPC processing using
asynchronous executions"), on top of ``rl_cartpole.py``, whose observers, policy and
REINFORCE update it reuses.  Only the agent's ``select_action`` changes: it is an
``@asyncrpc.functions.async_execution`` method that stores the caller's state and returns
an asyncio future, holding no thread.  Once every observer still playing has sent its
state for this step, the agent runs ONE policy forward over all of them, samples all
actions at once and answers every future.  An observer whose episode is over stops
calling, so the agent stops waiting for it as soon as its ``run_episode`` returns.

After training, the observer workers play a few episodes with the trained policy, in
turns, for this batched agent and for the unbatched agent of ``rl_cartpole.py`` (one
forward per call, on its own observers there), without learning, and the script prints
a ``speedup over the unbatched agent`` line, in environment steps per second.  Expect a
modest number with a policy this small: its forward pass costs about half as much as
handling one call, so batching cuts the agent's work per step by about a quarter, while
every observer now waits for the slowest one each step.  On a 2-core machine running 5 workers it
measured 1.05x-1.4x (and below 1 for barely trained policies, whose short episodes leave
half-empty batches).

    python examples/batch_rl_agent.py              # spawns 1 agent + 4 observers on loopback
    torchrun --nproc-per-node 5 examples/batch_rl_agent.py

The run succeeds when the last 10 episodes average at least 3x the first 10; it prints
``RESULT reward_ratio=<last 10 / first 10>``.  By default it trains 60 episodes of up to
500 steps and times 3 episodes per agent (``--smoke``: 40 episodes of up to 200 steps,
1 timed episode each), about 40 seconds on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time

import torch
from _launch import base_parser, launch
from rl_cartpole import (
    AGENT,
    Agent,
    add_options,
    apply_defaults,
    observer_name,
    report,
    sample,
    train,
)

import asyncrpc
from asyncrpc.functions import async_execution


class BatchAgent(Agent):
    """An ``Agent`` whose ``select_action`` answers all observers with one forward pass."""

    def __init__(self, observers: int, seed: int, max_steps: int) -> None:
        super().__init__(observers, seed, max_steps)
        # Every batch holds the states of the same observers in the same order, so one
        # generator keeps the run reproducible.
        self.generator = torch.Generator().manual_seed(seed * 100 + 99)
        self.playing: set[int] = set()
        self.waiting: dict[int, tuple[torch.Tensor, asyncio.Future[int]]] = {}

    @async_execution
    def select_action(self, ob_id: int, state: torch.Tensor) -> asyncio.Future[int]:  # type: ignore[override]
        """Queue observer ``ob_id``'s state; its future gets the action once the batch is full."""
        action: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiting[ob_id] = (state, action)
        self.step_if_ready()
        return action

    def step_if_ready(self) -> None:
        """One forward for every waiting state, once each observer still playing has sent one."""
        if not self.waiting or len(self.waiting) < len(self.playing):
            return
        ob_ids = sorted(self.waiting)
        states = torch.stack([self.waiting[i][0] for i in ob_ids])
        actions, log_probs = sample(self.policy, states, self.generator)
        for row, ob_id in enumerate(ob_ids):
            self.log_probs[ob_id].append(log_probs[row])
            self.waiting.pop(ob_id)[1].set_result(int(actions[row]))

    async def run_episode(self) -> list[list[float]]:
        """As ``Agent.run_episode``; an observer leaves the batch when its episode ends."""
        self.playing = set(range(len(self.observers)))
        episodes = [ob.rpc_async().run_episode(self.rref, self.max_steps) for ob in self.observers]
        for ob_id, episode in enumerate(episodes):
            episode.add_done_callback(functools.partial(self.stop_waiting_for, ob_id))
        return await asyncio.gather(*episodes)

    def stop_waiting_for(self, ob_id: int, _episode: asyncio.Future[list[float]]) -> None:
        self.playing.discard(ob_id)
        self.step_if_ready()

    def backward(self, returns: list[torch.Tensor]) -> None:
        """One backward for all observers: their steps share each batch's forward pass (and
        the batches ran in a fixed order, so the run stays reproducible)."""
        log_probs = torch.stack([lp for ob in self.log_probs for lp in ob])
        (-(log_probs * torch.cat(returns)).sum()).backward()


async def steps_per_second(agent: Agent) -> tuple[int, float]:
    """Play one episode for every observer, without learning: (environment steps, seconds)."""
    started = time.perf_counter()
    rewards = await agent.run_episode()
    elapsed = time.perf_counter() - started
    agent.forget_episode()
    return sum(len(r) for r in rewards), elapsed


async def compare_speed(batched: BatchAgent, args: argparse.Namespace, rounds: int) -> float:
    """Steps/s of ``batched`` over those of an unbatched ``Agent`` with the same policy."""
    plain = Agent(len(batched.observers), args.seed, args.max_steps)
    plain.policy.load_state_dict(batched.policy.state_dict())
    totals = {"unbatched": [0, 0.0], "batched": [0, 0.0]}
    for _ in range(rounds):  # in turns, so both see the same machine load
        for tag, agent in (("unbatched", plain), ("batched", batched)):
            steps, seconds = await steps_per_second(agent)
            totals[tag][0] += steps
            totals[tag][1] += seconds
    rates = {tag: steps / seconds for tag, (steps, seconds) in totals.items()}
    print(
        f"acting with the trained policy: unbatched {rates['unbatched']:.0f} steps/s, "
        f"batched {rates['batched']:.0f} steps/s",
        flush=True,
    )
    return rates["batched"] / rates["unbatched"]


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    apply_defaults(args)
    name = AGENT if rank == 0 else observer_name(rank - 1)
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    if rank == 0:
        agent = BatchAgent(world - 1, args.seed, args.max_steps)
        history = await train(agent, args.episodes, tag="batched agent")
        speedup = await compare_speed(
            agent, args, rounds=args.speed_rounds or (1 if args.smoke else 3)
        )
        print(f"speedup over the unbatched agent: {speedup:.2f}×", flush=True)  # noqa: RUF001
        report(history)
    await asyncrpc.shutdown()  # observers: serve the agent for as long as it trains


if __name__ == "__main__":
    parser = add_options(base_parser(__doc__.split("\n")[0], world=5))
    parser.add_argument(
        "--speed-rounds", type=int, help="episodes timed per agent (default 3, smoke 1)"
    )
    launch(worker, parser)
