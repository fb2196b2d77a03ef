"""Smoke runs of the model-parallel examples: each must really learn.

* ``rnn_model_parallel``: embedding and decoder on a server, LSTM on the trainer;
* ``ddp_rpc_hybrid``: a remote EmbeddingBag with a DDP Linear on two trainers;
* ``pipeline_parallel``: a two-shard MLP fed micro-batches through RRefs.
"""

from __future__ import annotations

import re

import pytest

from tests.examples.runner import run_example, run_example_with_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_rnn_model_parallel_learns() -> None:
    results = run_example("rnn_model_parallel", "--smoke")
    assert results["loss_ratio"] <= 0.5, results


def test_ddp_rpc_hybrid_learns_and_keeps_replicas_identical() -> None:
    results, stdout = run_example_with_output("ddp_rpc_hybrid", "--smoke")
    assert results["loss_ratio"] <= 0.5, results
    assert "trainers' Linear weights identical: True" in stdout
    gaps = re.findall(r"\[trainer(\d)\] epoch .* differ from the other trainer's by (\S+)", stdout)
    assert {rank for rank, _ in gaps} == {"0", "1"}
    assert all(float(gap) == 0.0 for _, gap in gaps), gaps


def test_pipeline_parallel_learns_and_times_every_split() -> None:
    results, stdout = run_example_with_output("pipeline_parallel", "--smoke")
    assert results["loss_ratio"] < 0.5, results
    timed = re.findall(
        r"\[master\]\s+(\d) splits?\s*: forward\s+([\d.]+) ms, step\s+([\d.]+) ms", stdout
    )
    assert {splits for splits, _, _ in timed} == {"1", "2", "4"}, stdout
    assert all(0 < float(forward) < float(step) for _, forward, step in timed), timed
