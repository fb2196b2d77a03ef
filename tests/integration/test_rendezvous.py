"""Rendezvous through torch's c10d stores: env:// (plain and under torchrun), file://."""

from __future__ import annotations

import operator
import os
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from asyncrpc.errors import RPCTimeoutError
from asyncrpc.rendezvous import create_store
from asyncrpc.rendezvous import store as store_module
from tests.cluster import ROOT, free_port, run_job, run_script

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
    assert agent_store.check(["asyncrpc/job1/worker/0", "asyncrpc/job1/worker/1"])


def test_file_rendezvous(tmp_path: Path) -> None:
    env = {"TEST_INIT_METHOD": f"file://{tmp_path / 'store'}"}
    workers = run_job("rendezvous", env=env)
    assert [w.result["peer_says"] for w in workers] == ["w1", "w0"]


@pytest.mark.parametrize("store", ["file", "tcp"])
def test_duplicate_worker_names_fail_on_every_rank(tmp_path: Path, store: str) -> None:
    env = {"TEST_WORKER_NAME": "same"}
    if store == "file":  # (tcp: rank 0 hosts the store, and must wait for the others)
        env["TEST_INIT_METHOD"] = f"file://{tmp_path / 'store'}"
    for worker in run_job("rendezvous", env=env):
        assert worker.result["init_error"] == "ValueError"
        assert "'same' is not unique" in worker.result["message"]


def test_ranks_that_wait_for_a_late_one_print_nothing() -> None:
    """The ranks that joined wait for the last with one store wait each: torch's store
    client logs two warnings for every wait that times out, so a poll in short waits
    printed a dozen lines a second on every rank waiting."""
    workers = run_job("late_rank", world=3)
    for worker in workers:
        assert worker.result["next_says"] == f"w{(worker.rank + 1) % 3}"
        assert "waitForInput" not in worker.stderr, worker.describe()


def test_a_missing_worker_is_named_on_every_rank() -> None:
    env = {"TEST_WORLD_SIZE": "3", "TEST_RPC_TIMEOUT": "3"}
    for worker in run_job("rendezvous", env=env):
        assert worker.result["init_error"] == "RPCTimeoutError"
        assert "rank(s) [2] of 3 have not joined" in worker.result["message"]


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


def test_env_rendezvous_beside_a_process_group_shares_its_store_server() -> None:
    """As torch's RPC does: rank 0 shares the server already on MASTER_PORT in-process."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    workers = run_job("rendezvous_beside_process_group", env=env)
    assert [w.result["peer_says"] for w in workers] == ["w1", "w0"]


def test_rank0_hosts_the_store_on_the_job_address_only() -> None:
    """The store holds the job secret: it must not answer on other addresses."""
    port = free_port()
    store = create_store(f"tcp://127.0.0.1:{port}", 0, 2, 10)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # another address of this host
        socket.create_connection(("127.0.0.2", port), timeout=5)
    del store


def test_rank0_reports_a_port_taken_by_another_process() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(dist.DistNetworkError, match=r"(?i)in use"):
            create_store(f"tcp://127.0.0.1:{port}", 0, 2, 10)


def test_a_listener_that_never_answers_fails_the_rendezvous_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's TCPStore client waits for the server's answer without a bound: against a
    listener that is no store (the kernel takes the connection, nobody answers) it
    would wait forever. The rendezvous gives up after its timeout and a grace."""
    monkeypatch.setattr(store_module, "STORE_ANSWER_GRACE", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(RPCTimeoutError, match=rf"127\.0\.0\.1:{port} took the connection"):
            create_store(f"tcp://127.0.0.1:{port}", 1, 2, 0.5)
        assert time.monotonic() - started < 10


async def test_one_store_serves_jobs_in_a_row(tmp_path: Path) -> None:
    import asyncrpc

    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    for _ in range(2):  # the second job must not read the first one's records
        await asyncrpc.init_rpc("solo", rank=0, world_size=1, store=store)
        assert await asyncrpc.rpc_async("solo", operator.add, args=(1, 2)) == 3
        await asyncrpc.shutdown()


async def test_a_process_joins_a_new_job_at_a_new_address_with_fresh_peers() -> None:
    """A serving front end that restarts its workers: its second job is on a new store,
    where its fresh peer counts its first job; both meet at that store's first job."""
    import asyncrpc

    await asyncrpc.init_rpc("solo", rank=0, world_size=1, init_method=_tcp(free_port()))
    await asyncrpc.shutdown()
    address = _tcp(free_port())
    peer = subprocess.Popen(
        [sys.executable, "-c", _PEER.format(address=address)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        await asyncrpc.init_rpc("main", rank=0, world_size=2, init_method=address, rpc_timeout=30)
        assert await asyncrpc.rpc_async("peer", operator.add, args=(1, 2)) == 3
        await asyncrpc.shutdown()
        assert peer.wait(timeout=30) == 0
    finally:
        peer.kill()


_PEER = """
import asyncio, asyncrpc
async def main():
    await asyncrpc.init_rpc("peer", rank=1, world_size=2, init_method={address!r}, rpc_timeout=30)
    await asyncrpc.shutdown()
asyncio.run(main())
"""


def _tcp(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def test_torchrun_restarting_its_workers_meets_afresh_on_its_own_store() -> None:
    """torchrun keeps one store across restarts of its workers; the keys the failed
    attempt left there (its dead rank's included) must not be read as the next one's
    (before: ``worker name 'w1' is not unique``, or records of dead workers)."""
    done = run_script(
        *("-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2"),
        "tests/restart_worker.py",
        timeout=90,
    )
    out = done.stdout + done.stderr
    assert "attempt 0: rank 1 joined" in out, out  # the first attempt met, then failed
    # (attempt 0's rank 0 may have its answer too: its peer serves calls from the moment
    # it joined, the last steps of its own init_rpc included, until it dies)
    results = sorted(re.findall(r"RESULT attempt=1 rank=\d+ peer=w\d+", done.stdout))
    assert results == ["RESULT attempt=1 rank=0 peer=w1", "RESULT attempt=1 rank=1 peer=w0"], out


@pytest.mark.parametrize("freeze", ["1", "0"])
async def test_the_garbage_collector_leaves_what_exists_at_init_out_until_shutdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, freeze: str
) -> None:
    """A full collection would walk torch's objects and every module's with the loop
    stopped (tens of ms): init_rpc freezes them, shutdown gives them back, and
    ASYNCRPC_GC_FREEZE=0 leaves the collector alone."""
    import gc

    import asyncrpc

    monkeypatch.setenv("ASYNCRPC_GC_FREEZE", freeze)
    assert gc.get_freeze_count() == 0
    await asyncrpc.init_rpc("solo", rank=0, world_size=1, init_method=f"file://{tmp_path / 's'}")
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000 if freeze == "1" else frozen == 0
    finally:
        await asyncrpc.shutdown()
    assert gc.get_freeze_count() == 0
