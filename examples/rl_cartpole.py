"""REINFORCE on CartPole with one agent and several observers, over asyncrpc.

The reinforcement-learning half of PyTorch's "Getting started with distributed RPC
framework" tutorial, written the asyncio way.  Worker ``agent`` owns the policy network;
every other worker is an observer with its own gymnasium ``CartPole-v1`` environment.

* The agent creates one ``Observer`` on each observer worker with ``asyncrpc.remote`` and
  keeps the RRefs.  Each episode it runs ``ob.rpc_async().run_episode(...)`` on all of
  them at once (``asyncio.gather``).
* An observer's ``run_episode`` is a coroutine: each step it sends its state to the
  agent with ``agent.rpc_async().select_action(ob_id, state)`` (an ``async def`` that
  runs on the agent's event loop), applies the action, and at the end returns its
  rewards.  The agent records the log-probability of every action, per observer.
* After the episode the agent runs REINFORCE over all observers' trajectories
  (discounted returns, normalised together) and takes one Adam step.

An episode's reward is the mean, over observers, of how long the pole stayed up (at
most ``--max-steps``).  The run succeeds when the last 10 episodes average at least 3x
the first 10; it prints ``RESULT reward_ratio=<last 10 / first 10>``.  By default it
trains 60 episodes of up to 500 steps (``--smoke``: 40 episodes of up to 200 steps),
about half a minute on a 2-core machine.

    python examples/rl_cartpole.py                 # spawns 1 agent + 3 observers on loopback
    python examples/rl_cartpole.py --world 5       # 1 agent + 4 observers
    torchrun --nproc-per-node 4 examples/rl_cartpole.py

Every random choice is seeded (``--seed``): action sampling uses one generator per
observer, so a run does not depend on the order in which observers' calls arrive, and
the same seed gives the same result.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import gymnasium as gym
import torch
from _launch import base_parser, launch
from _progress import progress, say
from torch import nn

import asyncrpc

AGENT = "agent"
GAMMA = 0.99
HIDDEN = 128
LR = 1e-2


def observer_name(ob_id: int) -> str:
    """Observer ``ob_id`` (0-based) runs on rank ``ob_id + 1``."""
    return f"observer{ob_id + 1}"


class Policy(nn.Module):
    """A small MLP from CartPole's 4 state variables to the log-probabilities of 2 actions."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 2))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.net(states), dim=-1)


def sample(
    policy: Policy, states: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one action per row of ``states``; return the actions and their log-probs."""
    log_probs = policy(states)
    actions = torch.multinomial(log_probs.detach().exp(), 1, generator=generator)
    return actions.squeeze(1), log_probs.gather(1, actions).squeeze(1)


class Observer:
    """Lives on an observer worker: one CartPole environment, stepped on the agent's orders."""

    def __init__(self, ob_id: int, seed: int) -> None:
        self.id = ob_id
        self.env = gym.make("CartPole-v1")
        self.env.reset(seed=seed)  # later resets continue this seeded stream
        self.env.action_space.seed(seed)

    async def run_episode(self, agent: asyncrpc.RRef[Agent], max_steps: int) -> list[float]:
        """Play one episode, asking ``agent`` for every action; return the rewards."""
        state, _ = self.env.reset()
        rewards: list[float] = []
        for _ in range(max_steps):
            action = await self.act(agent, torch.as_tensor(state))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(float(reward))
            if terminated or truncated:
                break
        return rewards

    async def act(self, agent: asyncrpc.RRef[Agent], state: torch.Tensor) -> int:
        """This step's action: ask the agent, through its RRef."""
        action: int = await agent.rpc_async().select_action(self.id, state)
        return action


def discounted_returns(rewards: list[float]) -> list[float]:
    """``R_t = r_t + gamma * R_{t+1}`` for every step of one trajectory."""
    returns, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + GAMMA * running
        returns.append(running)
    return returns[::-1]


class Agent:
    """Lives on the agent worker: the policy, its optimizer and the observers' RRefs."""

    observer_type = Observer  # what the agent creates on each observer worker

    def __init__(self, observers: int, seed: int, max_steps: int) -> None:
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=LR)
        self.max_steps = max_steps
        self.rref = asyncrpc.RRef(self)
        self.observers = [
            asyncrpc.remote(observer_name(i), self.observer_type, args=(i, seed * 100 + i))
            for i in range(observers)
        ]
        # One generator per observer: each one's actions do not depend on call order.
        self.generators = [torch.Generator().manual_seed(seed * 100 + i) for i in range(observers)]
        self.log_probs: list[list[torch.Tensor]] = [[] for _ in range(observers)]

    async def select_action(self, ob_id: int, state: torch.Tensor) -> int:
        """Called by observer ``ob_id`` each step; runs on the agent's event loop."""
        action, log_prob = sample(self.policy, state.unsqueeze(0), self.generators[ob_id])
        self.log_probs[ob_id].append(log_prob[0])
        return int(action.item())

    async def run_episode(self) -> list[list[float]]:
        """Every observer plays one episode at once; their rewards, by observer."""
        return await asyncio.gather(
            *(ob.rpc_async().run_episode(self.rref, self.max_steps) for ob in self.observers)
        )

    def forget_episode(self) -> None:
        """Drop the recorded log-probs (after an update, or an episode not learned from)."""
        self.log_probs = [[] for _ in self.observers]

    def finish_episode(self, rewards: list[list[float]]) -> float:
        """One REINFORCE update from every observer's trajectory; the mean episode reward."""
        returns = torch.tensor([r for ob in rewards for r in discounted_returns(ob)])
        returns = (returns - returns.mean()) / (returns.std() + 1e-8)
        self.optimizer.zero_grad()
        self.backward(list(returns.split([len(ob) for ob in rewards])))
        self.optimizer.step()
        self.forget_episode()
        return statistics.fmean(sum(ob) for ob in rewards)

    def backward(self, returns: list[torch.Tensor]) -> None:
        """Gradients of the REINFORCE loss, ``-sum(log_prob * return)``, observer by observer.

        One backward over everything would add the steps' gradients up in the order their
        forward passes ran, which depends on how the observers' calls interleaved; one
        backward per observer, in a fixed order, keeps a seeded run reproducible.
        """
        for log_probs, ob_returns in zip(self.log_probs, returns, strict=True):
            (-(torch.stack(log_probs) * ob_returns).sum()).backward()


async def train(agent: Agent, episodes: int, tag: str = "agent") -> list[float]:
    """Run ``episodes`` episodes with an update after each; the reward of each."""
    history: list[float] = []
    started = time.monotonic()
    for episode in progress(range(1, episodes + 1), desc=f"[{tag}] episodes"):
        history.append(agent.finish_episode(await agent.run_episode()))
        if episode % 10 == 0 or episode == episodes:
            say(
                f"[{tag}] episode {episode:4d}  reward {history[-1]:6.1f}  "
                f"last-10 mean {statistics.fmean(history[-10:]):6.1f}  "
                f"({time.monotonic() - started:.1f}s)"
            )
    return history


def report(history: list[float]) -> None:
    """Print the first/last 10-episode means and the ``RESULT`` line."""
    first, last = statistics.fmean(history[:10]), statistics.fmean(history[-10:])
    print(f"mean reward: first 10 episodes {first:.1f}, last 10 episodes {last:.1f}", flush=True)
    print(f"RESULT reward_ratio={last / first:.3f}", flush=True)


def add_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options both RL examples share."""
    parser.add_argument("--episodes", type=int, help="episodes to train (default 60, smoke 40)")
    parser.add_argument(
        "--max-steps", type=int, help="cap on an episode's length (default 500, smoke 200)"
    )
    return parser


def apply_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the options left out, for a full run or a ``--smoke`` run."""
    if args.episodes is None:
        args.episodes = 40 if args.smoke else 60
    if args.max_steps is None:
        args.max_steps = 200 if args.smoke else 500
    return args


async def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    apply_defaults(args)
    name = AGENT if rank == 0 else observer_name(rank - 1)
    await asyncrpc.init_rpc(name, rank=rank, world_size=world, init_method="env://")
    if rank == 0:
        agent = Agent(world - 1, args.seed, args.max_steps)
        report(await train(agent, args.episodes))
    await asyncrpc.shutdown()  # observers: serve the agent for as long as it trains


if __name__ == "__main__":
    launch(worker, add_options(base_parser(__doc__.split("\n")[0], world=4)))
