"""Distributed autograd with DistributedDataParallel, in real processes."""

from __future__ import annotations

import pytest
import torch

from tests.cluster import free_port, run_job

pytestmark = pytest.mark.timeout(120)


def test_ddp_replicas_average_their_gradients_in_a_distributed_backward() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [w.result["steps"] for w in run_job("ddp_in_autograd_context", env=env)]
    for step in range(3):
        first, second = (r[step] for r in ranks)
        assert first["got"] == second["got"]  # the replicas stay equal
        for i, got in enumerate(first["got"]):
            average = (torch.tensor(first["alone"][i]) + torch.tensor(second["alone"][i])) / 2
            torch.testing.assert_close(torch.tensor(got), average)
