"""open_job: the ranks of a job agree on where its keys live, whatever earlier jobs
(finished, or failed half-way by dead processes) left in the store.  Real TCPStore,
one thread per rank."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from asyncrpc.errors import RPCTimeoutError
from asyncrpc.rendezvous.store import JOBS, PREFIX, create_store, listen_host_for, open_job
from tests.cluster import free_port

pytestmark = pytest.mark.timeout(60)
WORLD = 3


@pytest.fixture
def store() -> Iterator[Any]:
    yield dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", free_port(), WORLD, True, timedelta(seconds=10), wait_for_workers=False
    )


def client(store: Any, timeout: float = 10.0) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", store.port, WORLD, False, timedelta(seconds=timeout)
    )


def run_ranks(store: Any, ranks: list[int]) -> dict[int, Any]:
    """open_job on each rank in its own thread (each with its own client), started in
    the order given.  Returns the scoped stores by rank."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = {r: pool.submit(open_job, client(store), r, WORLD) for r in ranks}
        return {r: f.result(timeout=30) for r, f in futures.items()}


def agreed_job(store: Any, scoped: dict[int, Any]) -> int:
    """Every rank's scoped store names the same job: returns its number."""
    mark = secrets.token_hex(4)
    for rank, part in scoped.items():
        part.set(f"seen/{mark}/{rank}", b"")
    jobs = int(store.add(JOBS, 0))
    found = [
        j for j in range(1, jobs + 1)
        if all(store.check([f"{PREFIX}/job{j}/seen/{mark}/{r}"]) for r in scoped)
    ]  # fmt: skip
    assert len(found) == 1, found
    return found[0]


def test_a_fresh_store_opens_job_1(store: Any) -> None:
    assert agreed_job(store, run_ranks(store, [1, 2, 0])) == 1


def test_a_finished_job_in_the_store_is_not_joined_again(store: Any) -> None:
    """Ranks 1 and 2 of the next attempt start first and find job 1 open (without their
    tokens): they must wait for the job their own rank 0 opens."""
    assert agreed_job(store, run_ranks(store, [0, 1, 2])) == 1
    assert agreed_job(store, run_ranks(store, [1, 2, 0])) == 2
    assert agreed_job(store, run_ranks(store, [0, 2, 1])) == 3


def test_a_job_whose_rank0_died_before_opening_it_is_left(store: Any) -> None:
    """A failed attempt: its rank 0 took job 1 and died before every rank joined.  The
    next attempt's ranks that join job 1 move on to job 2 once their rank 0 takes it."""
    store.add(JOBS, 1)
    store.set(f"{PREFIX}/job1/created", b"")
    store.set(f"{PREFIX}/job1/joined/0", b"")
    store.set(f"{PREFIX}/job1/joined/2", b"old token")
    assert agreed_job(store, run_ranks(store, [1, 2, 0])) == 2


def test_a_missing_rank_is_named_by_the_others(store: Any) -> None:
    missing = r"rank\(s\) \[2\] of 3 have not joined"
    with ThreadPoolExecutor(2) as pool:
        zero = pool.submit(open_job, client(store, timeout=1.0), 0, WORLD)
        one = pool.submit(open_job, client(store, timeout=1.0), 1, WORLD)
        with pytest.raises(RPCTimeoutError, match=missing):
            one.result(timeout=30)
        with pytest.raises(RPCTimeoutError, match=missing):
            zero.result(timeout=30)


@pytest.mark.parametrize("init_method", ["foo://bar:1", "udp://127.0.0.1:29500", "127.0.0.1:29500"])
def test_an_init_method_of_another_scheme_is_named_unsupported(init_method: str) -> None:
    for step in (lambda: listen_host_for(init_method), lambda: create_store(init_method, 1, 2, 1)):
        with pytest.raises(ValueError, match=r"unsupported init_method .* \(use tcp://, env://"):
            step()


def test_a_tcp_init_method_without_a_port_says_so() -> None:
    with pytest.raises(ValueError, match="needs a host and a port"):
        listen_host_for("tcp://127.0.0.1")
