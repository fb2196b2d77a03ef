"""A torchrun job across two "hosts": network namespaces on a bridge (tests/netns.py).

One torchrun per namespace, the c10d rendezvous at the first one's address, runs
examples/parameter_server.py (``--smoke``): two workers on the first host (ps and a
trainer), one on the second.  The job must train (its ``RESULT accuracy`` line) and each
worker must listen on its own namespace's address, reached over tcp from the other
namespace and over a unix socket from its own (tests/example_probe.py prints where
each worker listened and its links).  Needs root and iproute2's ``ip``; about 20 s.

Two things a real cluster also needs, which the test passes as a deployment would:
``--local-addr`` (every namespace shares the machine's hostname, which resolves to
loopback here, so torchrun would otherwise publish ``localhost`` as the store's
address, ``MASTER_ADDR``) and ``--rdzv-conf is_host=`` (torchrun guesses which node
hosts the rendezvous store from the hostname too).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster import free_port
from tests.example_probe import PROBE_PREFIX
from tests.examples.runner import RESULT_PREFIX
from tests.netns import NEEDS_ROOT_AND_IP, Namespace, finish, network, start_in

pytestmark = [pytest.mark.timeout(180), *NEEDS_ROOT_AND_IP]
WORKERS = (2, 1)  # per node: ps and trainer1 on the first, trainer2 on the second
JOB_TIMEOUT = 120.0  # seconds, for both torchruns (the rendezvous waits 60 s at most)
LEARNED = 0.8  # held-out accuracy, as tests/examples/test_parameter_server_examples.py


@pytest.fixture
def hosts() -> Iterator[list[Namespace]]:
    with network(len(WORKERS)) as spaces:
        yield spaces


def torchrun(node: int, ns: Namespace, endpoint: str, job: str) -> list[str]:
    """The torchrun command for ``node`` (in ``ns``): the example under the probe."""
    return [
        *(sys.executable, "-m", "torch.distributed.run"),  # torchrun, of this venv
        *("--nnodes", str(len(WORKERS)), "--nproc-per-node", str(WORKERS[node])),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job),
        *("--rdzv-conf", f"is_host={int(node == 0)},join_timeout=60,read_timeout=60"),
        *("--local-addr", ns.address, "--max-restarts", "0", "--monitor-interval", "0.2"),
        *("-m", "tests.example_probe", "examples/parameter_server.py", "--smoke"),
    ]


def lines(stdout: str, prefix: str) -> list[str]:
    return [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("pods", [False, True], ids=["hosts", "pods"])
def test_torchrun_across_two_network_namespaces_trains_the_parameter_server(
    hosts: list[Namespace], pods: bool
) -> None:
    """``pods``: each node's torchrun in a PID namespace of its own too, as in a pod,
    with the RPC port fixed (``ASYNCRPC_LISTEN_PORT``, plus each worker's local rank)."""
    if pods and shutil.which("unshare") is None:
        pytest.skip("needs util-linux's `unshare`")
    endpoint, job = f"{hosts[0].address}:{free_port()}", f"multihost{os.getpid()}"
    env = {"ASYNCRPC_SECRET": f"job-{job}"}  # as a deployment would set it, on each node
    port = free_port()
    if pods:
        env["ASYNCRPC_LISTEN_PORT"] = str(port)
    wrap = ["unshare", "--pid", "--fork", "--kill-child"] if pods else []
    commands = [[*wrap, *torchrun(i, ns, endpoint, job)] for i, ns in enumerate(hosts)]
    procs = [start_in(ns, command, env) for ns, command in zip(hosts, commands, strict=True)]
    nodes = finish(procs, JOB_TIMEOUT)
    outputs = "\n".join(node.describe() for node in nodes)

    probes: dict[str, tuple[int, dict[str, Any]]] = {}  # worker -> its node, its probe
    for node in nodes:
        for line in lines(node.stdout, PROBE_PREFIX):
            probe = json.loads(line)
            probes[probe["name"]] = (node.rank, probe)
            print(f"node {node.rank}:", line)  # where each worker listened (pytest -s)
    assert sorted(p["rank"] for _, p in probes.values()) == [0, 1, 2], outputs
    for node_rank, probe in probes.values():
        ns = hosts[node_rank]
        assert probe["addresses"]["tcp"].startswith(f"tcp://{ns.address}:"), (probe, outputs)
        if pods:
            fixed = f"tcp://{ns.address}:{port + probe['local_rank']}"
            assert probe["addresses"]["tcp"] == fixed, (probe, outputs)
        assert probe["master_addr"] == hosts[0].address, (probe, outputs)
        for peer, link in probe["links"].items():
            if probes[peer][0] == node_rank:
                assert link["transport"] == "unix", (probe, outputs)
            else:
                assert link == {**link, "transport": "tcp", "why": "different network namespace"}
    assert any(probes[name][0] != probes["ps"][0] for name in probes), outputs

    results = [r for node in nodes for r in lines(node.stdout, RESULT_PREFIX)]
    assert len(results) == 1 and results[0].startswith("accuracy="), outputs
    assert float(results[0].partition("=")[2]) >= LEARNED, outputs
