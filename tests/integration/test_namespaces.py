"""Two workers in network namespaces of their own, joined by a veth pair: two pods (or
containers) of one node.  They share a kernel, but not their abstract unix sockets: the
link must be tcp, and the debug info must say why.  Needs root and iproute2's ``ip``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.cluster import ROOT, Worker, free_port
from tests.namespace_scenarios import LISTEN_ENV, RENDEZVOUS_ENV, SIZES

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or shutil.which("ip") is None,
        reason="network namespaces need Linux and iproute2's `ip`",
    ),
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="creating network namespaces and veth pairs needs root",
    ),
]
IP_TIMEOUT = 10.0  # seconds, per `ip` command
JOB_TIMEOUT = 90.0  # seconds, for both workers together


@dataclass(frozen=True)
class Namespace:
    name: str
    address: str  # its end of the veth pair


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT)


@pytest.fixture
def namespaces() -> Iterator[tuple[Namespace, Namespace]]:
    """Two fresh network namespaces joined by a veth pair, 10.213.N.1 and .2/24 (N from
    our pid: unique among concurrent runs of this machine); deleted (with the pair)
    whatever happens."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250 + 1}"
    pair = (Namespace(f"arpc{tag}a", f"{subnet}.1"), Namespace(f"arpc{tag}b", f"{subnet}.2"))
    veths = (f"arv{tag}a", f"arv{tag}b")  # interface names: 15 characters at most
    try:
        try:
            for ns in pair:
                ip("netns", "add", ns.name)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
        ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for ns, veth in zip(pair, veths, strict=True):
            ip("link", "set", veth, "netns", ns.name)
            ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", veth)
            ip("-n", ns.name, "link", "set", veth, "up")
            ip("-n", ns.name, "link", "set", "lo", "up")
        yield pair
    finally:
        undo = [("link", "del", veths[0]), *(("netns", "del", ns.name) for ns in pair)]
        for args in undo:  # a pair moved into the namespaces goes with them
            subprocess.run(["ip", *args], check=False, capture_output=True, timeout=IP_TIMEOUT)


def run_in_namespaces(
    pair: tuple[Namespace, Namespace], scenario: str, wrap: tuple[str, ...] = ()
) -> list[Worker]:
    """Rank r of ``scenario`` in ``pair[r]`` (under ``wrap``, a command prefix), the
    rendezvous at rank 0's address; both bounded by JOB_TIMEOUT."""
    port = free_port()
    procs = []
    for rank, ns in enumerate(pair):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            RENDEZVOUS_ENV: pair[0].address,
            LISTEN_ENV: ns.address,
        }
        command = [sys.executable, "-m", "tests.worker", scenario, str(rank), "2", str(port)]
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns.name, *wrap, *command, "uvloop", "tcp"],
                cwd=ROOT,
                env=env,
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


def assert_exchanged(worker: Worker) -> dict[str, object]:
    seen = worker.result
    assert seen["whoami"] == f"w{1 - worker.rank}"
    for nbytes in SIZES:
        assert seen[str(nbytes)] == {"digest": True, "echo": True}, nbytes
    return seen


def test_workers_in_two_network_namespaces_talk_over_tcp_and_say_why(
    namespaces: tuple[Namespace, Namespace],
) -> None:
    """One PID namespace still: the large tensors go through shared memory."""
    for worker in run_in_namespaces(namespaces, "namespace_scenarios.exchange"):
        seen = assert_exchanged(worker)
        assert seen["links"] == {
            f"w{1 - worker.rank}": {
                "transport": "tcp",
                "why": "different network namespace",
                "shared_memory": True,
                "shared_memory_why": "same kernel, PID namespace and user",
            }
        }
        assert seen["shared_memory_peak"] >= SIZES[-1]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's `unshare`")
def test_two_pods_of_one_node_share_neither_sockets_nor_memory(
    namespaces: tuple[Namespace, Namespace],
) -> None:
    """Each worker in a PID namespace of its own too (each is pid 1 there): a peer's
    ``/proc/<pid>`` is not that peer, so the large tensors go through the socket."""
    wrap = ("unshare", "--pid", "--fork", "--kill-child")
    for worker in run_in_namespaces(namespaces, "namespace_scenarios.exchange", wrap):
        seen = assert_exchanged(worker)
        assert seen["pid"] == 1
        assert seen["links"] == {
            f"w{1 - worker.rank}": {
                "transport": "tcp",
                "why": "different network namespace",
                "shared_memory": False,
                "shared_memory_why": "different PID namespace",
            }
        }
        assert seen["shared_memory_peak"] == 0
