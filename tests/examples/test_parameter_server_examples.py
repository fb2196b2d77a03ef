"""Smoke runs of the two parameter-server examples, on scikit-learn's 8x8 digits.

Chance is 0.10 on the ten digits.  The bar is 0.8 held-out accuracy: the smoke runs
reach 0.92-0.97 (``parameter_server``, 4 epochs of asynchronous SGD, whose result varies
with the trainers' interleaving) and about 0.96 (``batch_parameter_server``, 6 epochs,
deterministic for a seed), so 0.8 shows clear learning with room for the noise of
asynchronous updates on a loaded machine.
"""

from __future__ import annotations

import ast
import math
import re

import pytest

from tests.examples.runner import run_example, run_example_with_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

LEARNED = 0.8
SERVER_LINE = re.compile(
    r"^server: (\d+) updates in ([\d.]+) s, ([\d.]+) updates/s \((\d+) pushes\)$", re.M
)
PLAN_LINE = re.compile(r"^\[ps\] (\d+) trainers x (\d+) pushes; one update per (\d+) pushes$", re.M)
SIZES_LINE = re.compile(r"^batch sizes formed: (\{.*\})$", re.M)


def server_stats(stdout: str) -> dict[str, float]:
    """The batch server's plan and its ``server: ...`` line, as numbers."""
    plan, line = PLAN_LINE.search(stdout), SERVER_LINE.search(stdout)
    assert plan is not None and line is not None, stdout
    return {
        "trainers": int(plan[1]),
        "steps": int(plan[2]),
        "batch_update_size": int(plan[3]),
        "updates": int(line[1]),
        "seconds": float(line[2]),
        "rate": float(line[3]),
        "pushes": int(line[4]),
    }


def batch_sizes(stdout: str) -> dict[int, int]:
    """The server's ``batch sizes formed: {size: batches}`` line."""
    line = SIZES_LINE.search(stdout)
    assert line is not None, stdout
    sizes: dict[int, int] = ast.literal_eval(line[1])
    return sizes


def test_parameter_server_trains_the_server_model() -> None:
    results = run_example("parameter_server", "--smoke")
    assert results["accuracy"] >= LEARNED


def test_batch_parameter_server_one_update_per_batch() -> None:
    results, stdout = run_example_with_output("batch_parameter_server", "--smoke")
    assert results["accuracy"] >= LEARNED
    stats = server_stats(stdout)
    assert stats["trainers"] == 2 and stats["batch_update_size"] == 2
    assert stats["pushes"] == stats["trainers"] * stats["steps"]
    assert stats["updates"] == stats["pushes"] / stats["batch_update_size"]
    assert stats["rate"] > 0
    assert batch_sizes(stdout) == {2: stats["updates"]}
    assert results["mean_batch_size"] == 2


def test_batch_parameter_server_partial_last_batch() -> None:
    """3 trainers, 2 pushes per update: 3 x 15 pushes cannot all pair up, and once the
    other trainers are done the last one's pushes must be answered alone.  How many go
    alone depends on the interleaving, hence the bounds.  The server lowers ``max_size``
    to 1 when only one trainer still pushes, so they go at once: with a ``--max-wait``
    of 30 s, a lone push that waited for it would make training last over 30 s."""
    results, stdout = run_example_with_output(
        "batch_parameter_server",
        *("--world", "4", "--batch-update-size", "2", "--epochs", "1", "--max-wait", "30"),
    )
    stats = server_stats(stdout)
    assert stats["seconds"] < 30, stats
    assert stats["trainers"] == 3 and stats["batch_update_size"] == 2
    assert stats["pushes"] == 3 * stats["steps"]
    assert math.ceil(stats["pushes"] / 2) <= stats["updates"] < stats["pushes"]
    sizes = batch_sizes(stdout)
    assert set(sizes) <= {1, 2} and sizes.get(2, 0) > 0, sizes
    assert sum(sizes.values()) == stats["updates"]
    assert sum(size * n for size, n in sizes.items()) == stats["pushes"]
    assert 1 < results["mean_batch_size"] <= 2, results
