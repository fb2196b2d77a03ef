"""Rendezvous through torch's c10d stores: env:// (plain and under torchrun), file://."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.cluster import free_port, run_job

pytestmark = pytest.mark.timeout(120)


def test_env_rendezvous_rank0_hosts_the_store() -> None:
    port = free_port()
    env = {"TEST_INIT_METHOD": "env://", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    workers = run_job("rendezvous", env=env)
    assert [w.result["peer_says"] for w in workers] == ["w1", "w0"]


def test_env_rendezvous_under_torchrun_uses_the_agent_store() -> None:
    """torchrun's elastic agent hosts the store: no rank may bind MASTER_PORT."""
    port = free_port()
    agent_store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 3, True, timedelta(seconds=30), wait_for_workers=False
    )
    env = {
        "TEST_INIT_METHOD": "env://",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    workers = run_job("rendezvous", env=env)
    assert [w.result["peer_says"] for w in workers] == ["w1", "w0"]
    assert agent_store.check(["asyncrpc/worker/0", "asyncrpc/worker/1"])


def test_file_rendezvous(tmp_path: Path) -> None:
    env = {"TEST_INIT_METHOD": f"file://{tmp_path / 'store'}"}
    workers = run_job("rendezvous", env=env)
    assert [w.result["peer_says"] for w in workers] == ["w1", "w0"]


def test_duplicate_worker_names_fail_on_every_rank(tmp_path: Path) -> None:
    env = {"TEST_INIT_METHOD": f"file://{tmp_path / 'store'}", "TEST_WORKER_NAME": "same"}
    for worker in run_job("rendezvous", env=env):
        assert worker.result["init_error"] == "ValueError"
        assert "'same'" in worker.result["message"]


async def test_init_rpc_passes_its_options_to_the_agent(tmp_path: Path) -> None:
    import asyncrpc
    from asyncrpc.agent import current_agent

    await asyncrpc.init_rpc(
        "solo",
        rank=0,
        world_size=1,
        init_method=f"file://{tmp_path / 'store'}",
        handshake_timeout=3.5,
        busy_poll=0,
    )
    try:
        agent = current_agent()
        assert agent is not None
        assert (agent.options.handshake_timeout, agent.options.busy_poll) == (3.5, 0)
    finally:
        await asyncrpc.shutdown()
