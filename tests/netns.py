"""Two "hosts" on one machine: network namespaces joined by a veth pair (needs root).

``veth_pair()`` makes two fresh network namespaces, ``arpc<tag>a`` and ``arpc<tag>b``,
each holding one end of a veth pair (``arv<tag>a``, ``arv<tag>b``) with the addresses
10.213.N.1 and 10.213.N.2/24, and deletes them whatever happens; by hand::

    ip netns add A; ip netns add B
    ip link add va type veth peer name vb
    ip link set va netns A; ip link set vb netns B
    ip -n A addr add 10.213.1.1/24 dev va; ip -n B addr add 10.213.1.2/24 dev vb
    ip -n A link set va up; ip -n B link set vb up
    ip -n A link set lo up; ip -n B link set lo up

``run_in_namespaces`` runs rank r of a scenario (``tests/worker.py``) in namespace r
with ``ip netns exec``, the rendezvous at rank 0's address.  Used by
tests/integration/test_namespaces.py and test_partition.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

import asyncrpc
from tests.cluster import ROOT, Worker, free_port

if TYPE_CHECKING:
    from tests.scenarios import Config

RENDEZVOUS_ENV = "ASYNCRPC_TEST_RENDEZVOUS_HOST"
LISTEN_ENV = "ASYNCRPC_TEST_LISTEN_HOST"
IP_TIMEOUT = 10.0  # seconds, per `ip` command
JOB_TIMEOUT = 90.0  # seconds, for both workers together
NEEDS_ROOT_AND_IP = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or shutil.which("ip") is None,
        reason="network namespaces need Linux and iproute2's `ip`",
    ),
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="creating network namespaces and veth pairs needs root",
    ),
]


@dataclass(frozen=True)
class Namespace:
    name: str
    address: str  # its end of the veth pair
    veth: str  # the name of that end


async def join_from_namespace(cfg: Config, **options: Any) -> None:
    """``init_rpc`` for a worker run by :func:`run_in_namespaces`: rendezvous at the
    address and listening on the one its environment names (``cfg``: a scenario's
    ``tests.scenarios.Config``)."""
    await asyncrpc.init_rpc(
        cfg.name,
        rank=cfg.rank,
        world_size=cfg.world,
        init_method=f"tcp://{os.environ[RENDEZVOUS_ENV]}:{cfg.port}",
        listen_host=os.environ[LISTEN_ENV],
        **options,
    )


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT)


@contextmanager
def veth_pair() -> Iterator[tuple[Namespace, Namespace]]:
    """Two fresh network namespaces joined by a veth pair, 10.213.N.1 and .2/24 (N from
    our pid: unique among concurrent runs of this machine); deleted (with the pair)
    whatever happens.  Skips the test if namespaces cannot be made here."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250 + 1}"
    veths = (f"arv{tag}a", f"arv{tag}b")  # interface names: 15 characters at most
    pair = (
        Namespace(f"arpc{tag}a", f"{subnet}.1", veths[0]),
        Namespace(f"arpc{tag}b", f"{subnet}.2", veths[1]),
    )
    try:
        try:
            for ns in pair:
                ip("netns", "add", ns.name)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
        ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for ns in pair:
            ip("link", "set", ns.veth, "netns", ns.name)
            ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.veth)
            ip("-n", ns.name, "link", "set", ns.veth, "up")
            ip("-n", ns.name, "link", "set", "lo", "up")
        yield pair
    finally:
        undo = [("link", "del", veths[0]), *(("netns", "del", ns.name) for ns in pair)]
        for args in undo:  # a pair moved into the namespaces goes with them
            subprocess.run(["ip", *args], check=False, capture_output=True, timeout=IP_TIMEOUT)


def run_in_namespaces(
    pair: tuple[Namespace, Namespace],
    scenario: str,
    wrap: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> list[Worker]:
    """Rank r of ``scenario`` in ``pair[r]`` (under ``wrap``, a command prefix; with
    ``env`` added to the environment), the rendezvous at rank 0's address; both
    bounded by JOB_TIMEOUT.  Fails unless both exit 0."""
    port = free_port()
    procs = []
    for rank, ns in enumerate(pair):
        environ = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            RENDEZVOUS_ENV: pair[0].address,
            LISTEN_ENV: ns.address,
            **(env or {}),
        }
        command = [sys.executable, "-m", "tests.worker", scenario, str(rank), "2", str(port)]
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns.name, *wrap, *command, "uvloop", "tcp"],
                cwd=ROOT,
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        workers = []
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=JOB_TIMEOUT)
            workers.append(Worker(rank, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=IP_TIMEOUT)
    for worker in workers:
        assert worker.returncode == 0, "\n".join(w.describe() for w in workers)
    return workers
