"""REINFORCE on CartPole with a batching agent: ``@batch`` runs one forward for many observers.

The batched agent of PyTorch's RPC tutorials ("Implementing batch RPC processing using
asynchronous executions"), on top of ``rl_cartpole.py``, whose policy, REINFORCE update and
observers it reuses.  The tutorial gathers the observers' states by hand (a future per
step, a lock, ``@async_execution``); here ``@asyncrpc.functions.batch`` does it:

* Each step an observer sends one item, its id and its state, to the agent:
  ``rpc_async(agent_rref.owner(), select_action, args=((ob_id, state),))``.
* ``select_action`` is a module-level function of a *list* of such items, served with
  ``@batch``, whose limits the agent sets at start-up from the command line
  (``select_action.configure(max_size=<observers>, max_wait=--max-wait)``): once every
  acting observer's state waits (or the oldest has waited ``--max-wait`` seconds) it runs
  ONE policy forward over the stacked states, samples each observer's action with that
  observer's own generator, records the log-probabilities and returns one action per
  item.  It is an ``async def``, so it runs on the agent's event loop, as the tutorial's
  agent does: a forward pass this small costs less than a hop to the thread pool.
* A batched function travels by name, so it reaches the agent's state (policy, recorded
  log-probs) through a class attribute, ``BatchAgent.serving``; the agent still creates its
  observers through RRefs and hands them its own RRef, which tells them where to send.
* ``@batch`` does not know which observers still play, but the agent does: when an
  observer's episode is over (its ``run_episode`` returns), the agent lowers ``max_size``
  to the observers still acting, so their states no longer wait ``--max-wait`` for one
  that will not come (a waiting batch starts at once); each episode starts with
  ``max_size`` back at the number of observers.

After training, the observer workers play a few episodes with the trained policy, in
turns, for this batched agent and for the unbatched agent of ``rl_cartpole.py`` (one
forward per call, on its own observers there), without learning, and the script prints
a ``speedup over the unbatched agent`` line, in environment steps per second.  Expect
little with a policy this small: its forward pass costs about half as much as handling
one call, so batching cuts the agent's work per step by about a quarter, while every
observer now waits for the slowest one each step.  On a 2-core machine running 5
workers (shared with other work, so noisy) it measured 1.0x-1.25x (the hand-made agent
this example replaced, which knew who still played: 1.2x-1.4x).  A trained policy keeps
the pole up to the step cap on every observer, so the timed episodes end together; it is
training, whose episodes end at different steps, that lowering ``max_size`` speeds up:
before it, every step after an observer's episode ended waited ``--max-wait``, and
training took about twice as long (default run 50 s against 28 s; ``--smoke`` 14 s
against 7 s).  Then it prints the sizes of the batches ``select_action`` formed on the
agent (``select_action.stats()``, training and timed episodes together): ``batch sizes
formed: {size: batches, ...}`` and ``RESULT mean_batch_size=<items / batches>`` (about
3.3 with 4 observers).

    python examples/batch_rl_agent.py              # spawns 1 agent + 4 observers on loopback
    torchrun --nproc-per-node 5 examples/batch_rl_agent.py

The run succeeds when the last 10 episodes average at least 3x the first 10; it prints
``RESULT reward_ratio=<last 10 / first 10>``.  By default it trains 60 episodes of up to
500 steps and times 3 episodes per agent (``--smoke``: 40 episodes of up to 200 steps,
1 timed episode each), about a minute on a 2-core machine (``--smoke``: 20 seconds).
Actions are sampled per observer, so they do not depend on how the states were batched,
but the float sums of a batched forward and backward do: unlike ``rl_cartpole.py``, a
seed pins the run only up to rounding.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import ClassVar

import torch
from _launch import base_parser, launch
from rl_cartpole import (
    AGENT,
    Agent,
    Observer,
    add_options,
    apply_defaults,
    observer_name,
    report,
    train,
)

import asyncrpc
from asyncrpc.functions import batch

Request = tuple[int, torch.Tensor]  # (observer id, its state)


@batch  # its limits come from the command line: the agent configures them (worker())
async def select_action(requests: list[Request]) -> list[int]:
    """The agent's batched step: one action per (observer id, state), in order."""
    agent = BatchAgent.serving
    assert agent is not None, "select_action is served by the agent worker"
    return agent.act(requests)


class BatchObserver(Observer):
    """An ``Observer`` that sends its state to the agent's batched ``select_action``."""

    async def act(self, agent: asyncrpc.RRef[Agent], state: torch.Tensor) -> int:
        action: int = await asyncrpc.rpc_async(
            agent.owner(), select_action, args=((self.id, state),)
        )
        return action


class BatchAgent(Agent):
    """An ``Agent`` whose observers' steps reach it in batches, through ``select_action``."""

    observer_type = BatchObserver
    serving: ClassVar[BatchAgent | None] = None  # on the agent worker: what select_action uses

    def __init__(self, observers: int, seed: int, max_steps: int) -> None:
        super().__init__(observers, seed, max_steps)
        self.acting = 0  # observers whose episode is not over yet
        BatchAgent.serving = self

    async def run_episode(self) -> list[list[float]]:
        """Every observer plays one episode at once; a batch is all of them to begin with."""
        self.acting = len(self.observers)
        select_action.configure(max_size=self.acting)
        return await asyncio.gather(*(self.play(ob) for ob in self.observers))

    async def play(self, observer: asyncrpc.RRef[Observer]) -> list[float]:
        """One observer's episode; once it is over, batches stop waiting for its states."""
        try:
            rewards: list[float] = await observer.rpc_async().run_episode(self.rref, self.max_steps)
        finally:
            self.acting -= 1
        if self.acting:  # the others' states go as soon as all of theirs wait
            select_action.configure(max_size=self.acting)
        return rewards

    def act(self, requests: list[Request]) -> list[int]:
        """One policy forward over the stacked states; each observer's action is sampled
        with its own generator, and its log-probability recorded."""
        log_probs = self.policy(torch.stack([state for _, state in requests]))
        probs = log_probs.detach().exp()
        actions = []
        for row, (ob_id, _) in enumerate(requests):
            action = int(torch.multinomial(probs[row], 1, generator=self.generators[ob_id]))
            self.log_probs[ob_id].append(log_probs[row, action])
            actions.append(action)
        return actions

    def backward(self, returns: list[torch.Tensor]) -> None:
        """One backward for all observers: their steps share the batches' forward passes,
        so one observer's backward would free the graph the others still need."""
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


def report_batches() -> float:
    """Print the batch sizes ``select_action`` formed on this (the agent's) worker; their mean."""
    stats = select_action.stats()
    print(f"batch sizes formed: {stats['sizes']}", flush=True)
    mean: float = stats["items"] / stats["batches"]
    return mean


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    apply_defaults(args)
    name = AGENT if rank == 0 else observer_name(rank - 1)
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    if rank == 0:  # the agent serves select_action: its limits, from the command line
        select_action.configure(max_size=world - 1, max_wait=args.max_wait)
        agent = BatchAgent(world - 1, args.seed, args.max_steps)
        history = await train(agent, args.episodes, tag="batched agent")
        speedup = await compare_speed(
            agent, args, rounds=args.speed_rounds or (1 if args.smoke else 3)
        )
        print(f"speedup over the unbatched agent: {speedup:.2f}×", flush=True)  # noqa: RUF001
        mean_batch_size = report_batches()
        report(history)
        print(f"RESULT mean_batch_size={mean_batch_size:.2f}", flush=True)
    await asyncrpc.shutdown()  # observers: serve the agent for as long as it trains


if __name__ == "__main__":
    parser = add_options(base_parser(__doc__.split("\n")[0], world=5))
    parser.add_argument(
        "--speed-rounds", type=int, help="episodes timed per agent (default 3, smoke 1)"
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=0.002,
        help="seconds a state waits for the other observers' before a smaller batch goes",
    )
    launch(worker, parser)
