"""Two workers in network namespaces of their own, joined by a veth pair: two pods (or
containers) of one node.  They share a kernel, but not their abstract unix sockets: the
link must be tcp, and the debug info must say why.  Needs root and iproute2's ``ip``."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.cluster import Worker
from tests.namespace_scenarios import SIZES
from tests.netns import NEEDS_ROOT_AND_IP, Namespace, run_in_namespaces, veth_pair

pytestmark = [pytest.mark.timeout(120), *NEEDS_ROOT_AND_IP]


@pytest.fixture
def namespaces() -> Iterator[tuple[Namespace, Namespace]]:
    """Two network namespaces joined by a veth pair (see tests/netns.py)."""
    with veth_pair() as pair:
        yield pair


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
