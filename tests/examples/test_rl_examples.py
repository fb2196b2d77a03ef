"""Smoke runs of the reinforcement-learning examples: both must really learn CartPole.

``--smoke`` trains 40 episodes, each capped at 200 steps.  The examples' own criterion is
a reward ratio (mean of the last 10 episodes over the first 10) of at least 3, which their
default runs meet with a wide margin (5x-18x over seeds 0-4).  Smoke runs are short, and
REINFORCE is noisy: once episodes start hitting the 200-step cap a run can slip back for
a few episodes, and across seeds 0-4 the smoke ratios were 2.6x-5.8x.  So the smoke test
asks for 2x: the last 10 episodes then average at least 50-100 steps against 25-50 at
the start, which a random policy (about 20 steps) never does; only a learned one does.
"""

from __future__ import annotations

import ast

import pytest

from tests.examples.runner import run_example, run_example_with_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

MIN_REWARD_RATIO = 2.0  # see the module docstring
OBSERVERS = 4  # batch_rl_agent's default world: 1 agent + 4 observers


def test_rl_cartpole_learns() -> None:
    results = run_example("rl_cartpole", "--smoke")
    assert results["reward_ratio"] >= MIN_REWARD_RATIO, results


def test_batch_rl_agent_learns_and_reports_speedup() -> None:
    results, stdout = run_example_with_output("batch_rl_agent", "--smoke")
    assert results["reward_ratio"] >= MIN_REWARD_RATIO, results
    speedup = [line for line in stdout.splitlines() if line.startswith("speedup over the")]
    assert len(speedup) == 1, stdout
    assert float(speedup[0].split(":")[1].strip().rstrip("×")) > 0, speedup  # noqa: RUF001
    sizes_line = [line for line in stdout.splitlines() if line.startswith("batch sizes formed:")]
    assert len(sizes_line) == 1, stdout
    sizes: dict[int, int] = ast.literal_eval(sizes_line[0].partition(":")[2].strip())
    assert sizes and all(1 <= size <= OBSERVERS for size in sizes), sizes
    mean = sum(size * n for size, n in sizes.items()) / sum(sizes.values())
    assert results["mean_batch_size"] == pytest.approx(mean, abs=0.01), (results, sizes)
    # The observers step together, so most steps' states share a batch (smoke runs: 3.1-3.4
    # states a batch); short ones are the steps of the last observers still playing, or of
    # an observer late by over --max-wait on a loaded machine.  Unbatched would be 1.
    assert 1.5 < results["mean_batch_size"] <= OBSERVERS, results
